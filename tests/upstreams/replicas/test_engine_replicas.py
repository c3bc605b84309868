"""Two real `firsttoken engine` processes behind a `prefix_affinity` route: the gateway keeps a
multi-turn session on the engine that holds its history, so that engine's prefix cache answers
the later turns (reported as `cached_tokens`), and where a new session lands depends on its
prompt alone, not on the gateway process or on what it served before.

The engines serve a tiny random checkpoint on CPU (a byte-level tokenizer: about one token per
character), so they start in seconds and a turn takes milliseconds."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from bench.harness import ROOT, free_port
from engine_backend.demo import RandomModelSpec, write_random_model
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV, GatewayThread

TINY = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=4096,
    tokenizer_vocab_size=300,
)
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
CHAT_LINE = '"POST /v1/chat/completions HTTP/1.1" 200'
ENGINE_BLOCK_TOKENS = 16  # the engine's KV block (EngineConfig.block_size): it caches whole ones
# ~1,500 characters each (~1,100 tokens): five whole 256-character blocks of the gateway's
# prefix index before the first user message. Each test uses its own, so that no test finds
# another's prefix cached.
BAKERY = "You are the support agent of a small bakery. Answer briefly and politely. " * 20
GARAGE = "You are the assistant of a car repair garage; quote prices in euros only. " * 20
LIBRARY = "You help readers of a public library find books; never invent a title. " * 20


@dataclass
class Engine:
    name: str
    proc: subprocess.Popen
    log: Path
    base_url: str

    def chat_requests(self) -> int:
        """Chat requests this engine answered, from its own access log."""
        return self.log.read_text(errors="replace").count(CHAT_LINE)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-replicas")
    write_random_model(str(path), TINY)
    return str(path)


def _start_engine(name: str, model: str, log: Path) -> Engine:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine_backend.server",
                "--model",
                model,
                "--device",
                "cpu",
                "--num-blocks",
                "512",  # 8k tokens of KV: plenty here, and no 1 GiB CPU cache per engine
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # the access log, line by line
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Engine(name, proc, log, f"http://127.0.0.1:{port}/v1")


def _wait_answering(engine: Engine, deadline: float) -> None:
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"engine {engine.name} exited:\n{engine.log.read_text()[-2000:]}")
        try:
            if httpx.get(engine.base_url + "/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"engine {engine.name} did not answer within {START_TIMEOUT_S} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory) -> Iterator[list[Engine]]:
    """Two engine processes on loopback, started together, stopped by pid afterwards."""
    logs = tmp_path_factory.mktemp("engine-logs")
    started: list[Engine] = []
    try:
        for name in ("e0", "e1"):
            started.append(_start_engine(name, tiny_model, logs / f"{name}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for engine in started:
            _wait_answering(engine, deadline)
        yield started
    finally:
        for engine in started:
            _stop(engine.proc)


def fleet_route(engines: list[Engine]) -> dict:
    return {
        "name": "fleet",
        "models": ["*"],
        "kind": "openai",
        "api_key_env": UPSTREAM_KEY_ENV,
        "replicas": [{"name": e.name, "base_url": e.base_url} for e in engines],
        "balance": "prefix_affinity",
    }


@dataclass
class Turn:
    engine: str  # which engine's access log grew by this turn's request
    prompt_tokens: int
    cached_tokens: int


def session(client: openai.OpenAI, engines: list[Engine], system: str, turns: int) -> list[Turn]:
    """A chat whose history grows turn by turn; for each turn, where it went and its usage."""
    messages: list[dict] = [{"role": "system", "content": system}]
    out: list[Turn] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: are you open on day {i}?"})
        before = [e.chat_requests() for e in engines]
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                stream=True,
                max_tokens=8,
                temperature=0,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        grew = _grown(engines, before)
        assert len(grew) == 1, f"turn {i}: access logs grew on {grew}"
        out.append(
            Turn(grew[0], usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)
        )
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages.append({"role": "assistant", "content": answer})
    return out


def _grown(engines: list[Engine], before: list[int], timeout: float = 5.0) -> list[str]:
    """The engines whose log shows one more chat request (the line lands as the answer ends)."""
    deadline = time.monotonic() + timeout
    while True:
        grew = [e.name for e, b in zip(engines, before, strict=True) if e.chat_requests() > b]
        if grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.02)


def replica_counts(gw: GatewayThread) -> dict[str, dict]:
    """The gateway's own per-replica figures (an open gateway shows them to anyone)."""
    body = httpx.get(gw.url + "/v1/metrics/ttft", timeout=10).json()
    return {r["name"]: r for r in body["replicas"]["fleet"]["replicas"]}


def test_a_session_stays_on_one_engine_and_its_later_turns_hit_the_cache(engines, make_gateway):
    gw = make_gateway([fleet_route(engines)])
    gw.wait_ready()
    client = sdk_client(gw, timeout=60)

    turns = session(client, engines, BAKERY, 4)
    home = turns[0].engine
    assert [t.engine for t in turns] == [home] * 4
    assert turns[0].cached_tokens == 0  # a fresh engine has seen nothing of it
    for previous, t in itertools.pairwise(turns):
        # everything the previous turn sent is reused, less at most its last partial blocks
        assert t.cached_tokens >= previous.prompt_tokens - 2 * ENGINE_BLOCK_TOKENS, turns
        assert t.cached_tokens < t.prompt_tokens
    states = replica_counts(gw)
    assert states[home]["requests"] == 4
    assert states[home]["affinity_hits"] == 3  # turns 2..4 chosen for their prefix
    assert sum(s["requests"] for s in states.values()) == 4


def test_where_a_session_lands_depends_on_its_prompt_only(engines, make_gateway):
    """Two gateway processes (fresh indexes, sessions in opposite order) put each session on
    the same engine: a prefix nobody holds goes where its own hash says, so gateways agree."""
    first = make_gateway([fleet_route(engines)])
    first.wait_ready()
    a = sdk_client(first, timeout=60)
    placed = {name: session(a, engines, system, 3) for name, system in SESSIONS}

    second = make_gateway([fleet_route(engines)])
    second.wait_ready()
    b = sdk_client(second, timeout=60)
    again = {name: session(b, engines, system, 3) for name, system in reversed(SESSIONS)}

    for name in placed:
        homes = {t.engine for t in placed[name] + again[name]}
        assert len(homes) == 1, (name, placed[name], again[name])
        # the engine kept the session's prefix: the second gateway's first turn hits it too
        reused = placed[name][0].prompt_tokens - 2 * ENGINE_BLOCK_TOKENS
        assert again[name][0].cached_tokens >= reused, (name, again[name])


SESSIONS = (("garage", GARAGE), ("library", LIBRARY))
