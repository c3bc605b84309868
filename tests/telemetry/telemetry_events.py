"""Deterministic synthetic request events, shared by the tests and the writer subprocess."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gateway.config.settings import Settings
from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.aggregate import Aggregate, fold_event
from gateway.telemetry.telemetry import FLUSH_BATCH, FLUSH_INTERVAL_S


def make_telemetry(
    redis_url: str | None = None,
    *,
    flush_interval_s: float = FLUSH_INTERVAL_S,
    flush_batch: int = FLUSH_BATCH,
    **settings: Any,
) -> Telemetry:
    """Telemetry as the gateway builds it, from `Settings` fields (`metrics_key_prefix=...`)."""
    return Telemetry.from_settings(
        Settings(**settings), redis_url, flush_interval_s=flush_interval_s, flush_batch=flush_batch
    )


def aggregate_events(events: Iterable[RequestEvent]) -> Aggregate:
    """The buckets a store's `write` takes, folded from `events` as the writer folds them."""
    aggregate: Aggregate = {}
    for event in events:
        fold_event(aggregate, event)
    return aggregate


def make_events(
    seed: int,
    count: int,
    tenant: str = "acme",
    routes: tuple[str, ...] = ("openai", "local"),
    now: float | None = None,
) -> list[RequestEvent]:
    """Lognormal TTFTs (median ~300 ms) over the last 20 minutes, some errors and non-streams."""
    rng = random.Random(seed)
    now = time.time() if now is None else now
    events = []
    for _ in range(count):
        upstream = rng.lognormvariate(-1.3, 0.6)
        stream = rng.random() < 0.9
        status = (
            "ok"
            if rng.random() < 0.95
            else rng.choice(["upstream_error", "timeout", "client_gone"])
        )
        ttft = upstream + rng.lognormvariate(-6.5, 0.5) if stream else None
        prompt = rng.randint(100, 5000)
        events.append(
            RequestEvent(
                tenant=tenant,
                route=rng.choice(routes),
                model="m",
                stream=stream,
                status=status,
                ttft_s=ttft,
                upstream_ttft_s=upstream,
                total_s=upstream + rng.uniform(0.5, 3.0),
                output_tokens=rng.randint(1, 300),
                mean_itl_s=rng.uniform(0.01, 0.05) if stream else None,
                prompt_tokens=prompt,
                cached_prompt_tokens=rng.randint(0, prompt),
                prompt_tokens_saved=rng.randint(0, 50),
                fallback=rng.random() < 0.05,
                ts=now - rng.uniform(0, 1200),
            )
        )
    return events


async def until(predicate, timeout_s: float) -> bool:
    """Poll `predicate` on the loop until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


WRITER = Path(__file__).with_name("telemetry_writer_process.py")


def write_in_processes(
    redis_url: str, key_prefix: str, env: dict, runs: list[tuple[int, int]], now: float
) -> list[RequestEvent]:
    """Each (seed, count) of `runs` written by a telemetry writer in a process of its own, all
    at once, as several gateway processes would; the union of the events they wrote."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(WRITER), redis_url, key_prefix, str(seed), str(count), repr(now)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed, count in runs
    ]
    for proc, (_, count) in zip(procs, runs, strict=True):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == f"written={count} dropped=0"
    return [e for seed, count in runs for e in make_events(seed, count, now=now)]
