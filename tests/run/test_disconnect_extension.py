"""The gateway's server tells a request that its client left through a future in the scope
(`firsttoken.disconnect`), so that watching costs no task per request; pipelined requests
learn it too, not only the newest."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from bench.harness import free_port
from gateway.boundary.client_watch import DISCONNECT_EXTENSION, disconnect_waiter
from gateway.config.settings import Settings
from gateway.run.server import server_config


class _App:
    """Holds every request open until its client leaves, and notes which ones learned it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.gone: list[str] = []
        self.extension_present: list[bool] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.seen.append(scope["path"])
        self.extension_present.append(DISCONNECT_EXTENSION in scope.get("extensions", {}))
        await receive()  # the (empty) body
        waiter = disconnect_waiter(scope, receive)
        try:
            await asyncio.wait_for(waiter, 30)
            self.gone.append(scope["path"])
        except TimeoutError:
            pass


def _serve(app: _App) -> tuple[uvicorn.Server, threading.Thread, int]:
    port = free_port()
    config = server_config(
        app, Settings(), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    return server, thread, port


def _wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_client_that_leaves_resolves_its_requests_future():
    app = _App()
    server, thread, port = _serve(app)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _wait(lambda: app.seen == ["/one"])
        assert _wait(lambda: app.gone == ["/one"])
        assert app.extension_present == [True]
    finally:
        server.should_exit = True
        thread.join(15)


def test_pipelined_requests_all_learn_that_their_client_left():
    app = _App()
    server, thread, port = _serve(app)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            assert _wait(lambda: app.seen == ["/first"])
        # The first was being answered when the client left. uvicorn marks only the newest
        # request (the queued second) as disconnected; the first must learn it all the same.
        assert _wait(lambda: "/first" in app.gone)
    finally:
        server.should_exit = True
        thread.join(15)
