"""One read full of pipelined requests costs the front door linear time.

A client may send a whole read (up to 256 KiB) of tiny pipelined requests; the front door keeps
each unanswered request with its disconnect future, and pruning that list by copying it on
every new head made one read of 8,000 requests hold the event loop for ~20 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.server import ServerState

from gateway.config.settings import Settings
from gateway.run.server import server_config

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.heads = 0  # response heads written

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name in ("sockname", "peername") else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.heads += bytes(data).count(b"HTTP/1.1 200 ")

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


async def _answers(scope: dict, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_read_of_pipelined_requests_costs_linear_time() -> None:
    async def feed() -> tuple[float, int]:
        config = server_config(_answers, Settings(), host="127.0.0.1", port=1, log_level="warning")
        config.load()
        protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=ServerState(), app_state={}
        )
        transport = _Transport()
        protocol.connection_made(transport)
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
