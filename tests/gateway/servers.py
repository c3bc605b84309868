"""Run the gateway for a test: uvicorn on 127.0.0.1, a free port, in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import uvicorn

from gateway.app import create_app
from gateway.server import server_config
from gateway.settings import Settings
from tests.local_servers import free_port


class GatewayThread:
    def __init__(self, settings: Settings, environ: Mapping[str, str] | None = None) -> None:
        self.app = create_app(settings, environ or {})
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
    def gateway(self):
        return self.app.state.gateway

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
        while not self.gateway.ready():
            if time.monotonic() > deadline:
                raise RuntimeError("gateway not ready")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)
