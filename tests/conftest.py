"""Fixtures that more than one test folder uses; the helpers behind them are in `tests/support`."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator

import orjson
import pytest
import redis

from bench.harness import free_port
from tests.support.redis_servers import SHARED_REDIS_URL, PrivateRedis, shared_redis_up


@pytest.fixture
def mock_upstream():
    """A mock OpenAI/Anthropic upstream on a loopback port (a `bench.mock_openai` server)."""
    # Imported here, not at the top: the engine tests never start a gateway or a mock.
    from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer

    with ThreadedServer(MockUpstream(MockBehaviour())) as server:
        yield server


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., object]]:
    """`make_gateway(routes, environ=None, **settings)` starts a gateway on a loopback port;
    every gateway it started stops after the test. The upstream key is in `MOCK_KEY`.

    A local route's engine runs in float32 unless a test asks otherwise: these tests compare
    answers across batching and prefix-cache hits, which bf16 (the engine's default on CPUs
    that have it) rounds differently; the engine's bf16 is tested in tests/engine.

    No big-body worker processes unless a test asks for them (`big_body_workers`): each spawns
    an interpreter that imports the gateway, a second or more of CPU per gateway, and the
    gateway's stop waits for them. Without them a big body is parsed in the gateway's process,
    as on routes of other kinds; the tests of the worker path ask for two."""
    from gateway.config.settings import load_settings
    from tests.support.gateway import UPSTREAM_KEY_ENV, GatewayThread

    started: list[GatewayThread] = []

    def make(routes: list[dict], environ: dict | None = None, **settings) -> GatewayThread:
        env = {UPSTREAM_KEY_ENV: "sk-upstream-secret", **(environ or {})}
        settings.setdefault("engine_dtype", "float32")
        settings.setdefault("big_body_workers", 0)
        gw = GatewayThread(
            load_settings(environ=env, routes=orjson.dumps(routes).decode(), **settings)
        )
        gw.__enter__()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.__exit__(None, None, None)


@pytest.fixture
def redis_url() -> str:
    """The shared Redis's test database; the test is skipped when no Redis answers."""
    if not shared_redis_up():
        pytest.skip("no Redis at 127.0.0.1:6379")
    return SHARED_REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A prefix unique to the test; every key under it is deleted afterwards. Request it before
    `make_gateway` so that the deletion runs after the gateways' last flush."""
    prefix = "fttest-" + uuid.uuid4().hex[:12]
    yield prefix
    with redis.Redis.from_url(redis_url) as client:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A throwaway redis-server on a free port, not yet started: the test calls `start()`, and
    may `kill()` and `start()` it again on the same port. It is killed after the test."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = PrivateRedis(free_port())
    yield server
    server.kill()
