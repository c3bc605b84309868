"""Run the gateway for a test: uvicorn on 127.0.0.1, a free port, in a background thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from bench.harness import free_port
from bench.mock_openai import ThreadedServer
from gateway.app import create_app
from gateway.boundary.admit import Admission
from gateway.boundary.auth import KeyRing
from gateway.config.routes import RouteTable
from gateway.config.settings import Settings, load_settings
from gateway.run.server import server_config
from gateway.upstreams.registry import Upstreams

UPSTREAM_KEY_ENV = "MOCK_KEY"
"""The variable `openai_route` names for the upstream key; `make_gateway` sets it."""


def openai_route(server: ThreadedServer, **extra: Any) -> dict:
    """An OpenAI-kind route to a mock upstream for `mock-*` and `gpt-*`; `extra` overrides."""
    return {
        "name": "mock",
        "models": ["mock-*", "gpt-*"],
        "kind": "openai",
        "base_url": server.base_url,
        "api_key_env": UPSTREAM_KEY_ENV,
        **extra,
    }


def anthropic_route(server: ThreadedServer, **extra: Any) -> dict:
    """An Anthropic-kind route to a mock upstream for `claude-*`; `extra` overrides."""
    return openai_route(server, name="claude", models=["claude-*"], kind="anthropic", **extra)


class GatewayThread:
    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.port = free_port()
        config = server_config(
            self.app,
            settings,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            loop="asyncio",
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def runtime(self):
        return self.app.state.runtime

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.runtime.ready():
            if time.monotonic() > deadline:
                raise RuntimeError("gateway not ready")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)


def capture_events(gw: GatewayThread) -> list:
    """Every telemetry event `gw` records from now on, in order (they are still recorded)."""
    telemetry = gw.runtime.telemetry
    original = telemetry.record
    events: list = []

    def record(event) -> None:
        events.append(event)
        original(event)

    telemetry.record = record
    return events


def wait_for(events: list, count: int = 1, timeout: float = 5.0, **fields: Any) -> list:
    """The events whose attributes equal `fields`, once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in events if all(getattr(e, k) == v for k, v in fields.items())]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) >= count, f"fewer than {count} events with {fields}: {events}"
            return found
        time.sleep(0.02)


def admission_for(keys: KeyRing) -> Admission:
    """An `Admission` with `keys` and no route, for endpoints tested without a gateway."""
    settings = load_settings(environ={})
    return Admission(settings, keys, Upstreams(RouteTable([]), settings))
