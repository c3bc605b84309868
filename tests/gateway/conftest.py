from __future__ import annotations

import orjson
import pytest

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.settings import Settings
from tests.gateway.servers import GatewayThread


@pytest.fixture
def mock_upstream():
    mock = MockUpstream(MockBehaviour())
    with ThreadedServer(mock) as server:
        yield server


def openai_route(server: ThreadedServer, **extra) -> dict:
    return {
        "name": "mock",
        "models": ["mock-*", "gpt-*"],
        "kind": "openai",
        "base_url": server.base_url,
        "api_key_env": "MOCK_KEY",
        **extra,
    }


@pytest.fixture
def make_gateway():
    started = []

    def make(routes: list[dict], environ: dict | None = None, **settings) -> GatewayThread:
        env = {"MOCK_KEY": "sk-upstream-secret", **(environ or {})}
        gw = GatewayThread(Settings(routes=orjson.dumps(routes).decode(), **settings), env)
        gw.__enter__()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.__exit__(None, None, None)
