"""One read full of pipelined requests: bounded in the requests it holds, linear in its time.

A client may send a whole read (up to 256 KiB) of tiny pipelined requests. Each parsed request
holds about 3 KB until it is answered (one read of 7,700 held 24 MB), so past
`max_pipelined_requests` waiting on one connection the rest is refused. Where a deployment
raises that cap, the front door still costs linear time: it keeps each unanswered request with
its disconnect future, and pruning that list by copying it on every new head made one read of
8,000 requests hold the event loop for ~20 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.server import ServerState

from gateway.config.settings import Settings
from gateway.run.server import server_config
from tests.support.transport import FakeTransport

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"


async def _answers(scope: dict, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _connected(app: Any, max_pipelined_requests: int) -> tuple[Any, FakeTransport]:
    """A front door's protocol, connected to a fake transport, on the running loop."""
    settings = Settings(max_pipelined_requests=max_pipelined_requests)
    config = server_config(app, settings, host="127.0.0.1", port=1, log_level="warning")
    config.load()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}
    )
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


def test_a_read_of_pipelined_requests_costs_linear_time() -> None:
    async def feed() -> tuple[float, int]:
        protocol, transport = _connected(_answers, 10_000)
        started = time.thread_time()  # this thread's CPU: other processes' load does not count
        protocol.data_received(REQUEST * 8000)  # 272,000 bytes, one read
        spent = time.thread_time() - started
        for _ in range(100 * 8000):  # then every request is answered, in order
            if transport.heads == 8000:
                break
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return spent, transport.heads

    spent, answered = asyncio.run(feed())
    assert spent < 2.0  # linear: ~0.2 s; copying the open list per head: ~20 s
    assert answered == 8000


def test_pipelined_requests_past_the_cap_are_refused_after_the_answers_owed() -> None:
    """8,000 requests in one read against a cap of 64: 64 are held and answered in order, the
    65th gets one 429 naming the variable, and the connection closes; nothing past it is parsed
    or answered."""
    held: list[int] = []

    async def slow_answer(scope: dict, receive: Any, send: Any) -> None:
        await asyncio.sleep(0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def feed() -> FakeTransport:
        protocol, transport = _connected(slow_answer, 64)
        protocol.data_received(REQUEST * 8000)
        held.append(len(protocol.pipeline) + 1)  # waiting, and the one being answered
        for _ in range(100_000):
            if transport.closed:
                break
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(feed())
    assert held == [64]
    written = bytes(transport.written)
    assert transport.heads == 64
    assert written.count(b"HTTP/1.1 ") == 65
    refusal = written[written.index(b"HTTP/1.1 429 ") :]
    assert b"too_many_pipelined_requests" in refusal
    assert b"FIRSTTOKEN_MAX_PIPELINED_REQUESTS" in refusal
    assert transport.closed
