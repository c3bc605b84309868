"""Shared pieces of the gateway benches: processes pinned to cores, and a bounded load loop.

The gateway gets core 0 to itself; the mock upstream and the load generator share core 1, so
what differs between a direct run and a run through the gateway is the gateway.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATEWAY_CORE, HARNESS_CORE = "0", "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_self(core: str = HARNESS_CORE) -> None:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {int(core)})


def _taskset(core: str) -> list[str]:
    return ["taskset", "-c", core] if os.cpu_count() and os.cpu_count() > 1 else []


def wait_http(url: str, timeout: float = 30.0) -> float:
    """Seconds until `url` answers 200."""
    import http.client
    import urllib.request

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except (OSError, http.client.HTTPException):
            # Not up yet: refused, reset, timed out (all OSError, HTTPError included) or a
            # half-started server's malformed reply.
            time.sleep(0.01)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def start_mock(
    first_ms: float = 50, chunks: int = 20, gap_ms: float = 5, extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen, str]:
    """`bench.mock_openai` on the harness core; `extra_args` go to its command line as they are
    (`--slow-share 0.05 --seed 1`, ...)."""
    port = free_port()
    return start_upstream(
        [
            *_taskset(HARNESS_CORE),
            sys.executable,
            "-m",
            "bench.mock_openai",
            "--port",
            str(port),
            "--first-ms",
            str(first_ms),
            "--chunks",
            str(chunks),
            "--gap-ms",
            str(gap_ms),
            *extra_args,
        ],
        port,
    )


def start_upstream(argv: list[str], port: int) -> tuple[subprocess.Popen, str]:
    """Start a mock upstream serving `/v1/models` on `port`; stopped again if it never answers."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_http(base + "/models")
    except RuntimeError:
        stop(proc)
        raise
    return proc, base


def start_gateway(
    upstream_base: str, extra_env: dict[str, str] | None = None, root: str | None = None
) -> tuple[subprocess.Popen, str, float]:
    """Start `firsttoken serve` on core 0; returns (process, base url, seconds to ready).
    `root`: another checkout to run the gateway from (a baseline), else this one."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIRSTTOKEN_")}
    env.update(
        {
            "FIRSTTOKEN_ROUTES": orjson.dumps(
                [{"name": "mock", "models": ["*"], "kind": "openai", "base_url": upstream_base}]
            ).decode(),
            "FIRSTTOKEN_LOG_LEVEL": "warning",
        }
    )
    env.update(extra_env or {})
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            *_taskset(GATEWAY_CORE),
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--port",
            str(port),
        ],
        cwd=root or ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/readyz")
    except RuntimeError:
        proc.kill()
        raise RuntimeError(proc.stderr.read().decode()[-2000:]) from None
    return proc, base + "/v1", time.perf_counter() - started


def start_minimal_passthrough(upstream_base: str) -> tuple[subprocess.Popen, str]:
    """The bare aiohttp relay of `bench/minimal_passthrough.py`, on the gateway's core."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *_taskset(GATEWAY_CORE),
            sys.executable,
            os.path.join(ROOT, "bench", "minimal_passthrough.py"),
            str(port),
            upstream_base,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return proc, f"http://127.0.0.1:{port}/v1"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


REQUEST = orjson.dumps(
    {"model": "mock-model", "stream": True, "messages": [{"role": "user", "content": "Say hello."}]}
)


@dataclass(frozen=True)
class Api:
    """One client API as the load speaks it: where it posts, what, and the bytes that mark the
    first content in its stream."""

    path: str
    body: bytes
    marker: bytes
    headers: tuple[tuple[str, str], ...] = ()


CHAT = Api("/chat/completions", REQUEST, b"tok0")


@dataclass
class LoadResult:
    ttft_ms: list[float]
    completed: int
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.ttft_ms:
            return float("nan")
        data = sorted(self.ttft_ms)
        return data[min(len(data) - 1, int(q / 100 * len(data)))]


async def load(
    base: str,
    concurrency: int,
    seconds: float,
    max_requests: int = 100_000,
    body: bytes | None = None,
    api: Api = CHAT,
) -> LoadResult:
    """Closed-loop load: `concurrency` workers each send streaming requests back to back until
    `seconds` pass or `max_requests` were sent. TTFT is time to the first content byte."""
    body = api.body if body is None else body
    headers = {
        "content-type": "application/json",
        "authorization": "Bearer bench",
        **dict(api.headers),
    }
    ttfts: list[float] = []
    counters = {"done": 0, "errors": 0, "sent": 0}
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while time.perf_counter() < deadline and counters["sent"] < max_requests:
                counters["sent"] += 1
                start = time.perf_counter()
                first = None
                try:
                    async with session.post(base + api.path, data=body, headers=headers) as resp:
                        if resp.status != 200:
                            counters["errors"] += 1
                            await resp.read()
                            continue
                        async for chunk in resp.content.iter_any():
                            if first is None and api.marker in chunk:
                                first = time.perf_counter()
                    if first is None:
                        counters["errors"] += 1
                        continue
                    ttfts.append((first - start) * 1000)
                    counters["done"] += 1
                except aiohttp.ClientError:
                    counters["errors"] += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    return LoadResult(ttfts, counters["done"], counters["errors"], elapsed)


def merge(results: list[LoadResult]) -> LoadResult:
    return LoadResult(
        [t for r in results for t in r.ttft_ms],
        sum(r.completed for r in results),
        sum(r.errors for r in results),
        sum(r.seconds for r in results),
    )


def interleaved(
    targets: dict[str, str] | dict[str, tuple[str, Api]],
    concurrency: int,
    seconds: float,
    rounds: int = 3,
) -> dict[str, LoadResult]:
    """Alternate the targets (a base URL, chat; or a base URL and an API) in short rounds so
    machine noise hits each the same way."""
    per_round = seconds / rounds
    pairs = {
        name: target if isinstance(target, tuple) else (target, CHAT)
        for name, target in targets.items()
    }
    for base, api in pairs.values():  # warm connection pools and lazy state, unmeasured
        asyncio.run(load(base, concurrency, 0.3, api=api))
    out: dict[str, list[LoadResult]] = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, (base, api) in pairs.items():
            out[name].append(asyncio.run(load(base, concurrency, per_round, api=api)))
    return {name: merge(rs) for name, rs in out.items()}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
