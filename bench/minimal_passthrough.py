"""The floor for any Python streaming proxy on this harness: a bare ASGI app that forwards a
chat request to the upstream and relays the response bytes, nothing else (no routing, policies,
telemetry or SSE parsing). `gateway_overhead.py` runs it beside the gateway twice: with
aiohttp's client, and with the gateway's own (`gateway.upstreams.http1`), so that what the
client costs is measured in the same run.

    python bench/minimal_passthrough.py PORT UPSTREAM_BASE_URL[,...] [aiohttp|http1]

With several upstreams it takes them in turn, one request each (`bench/fleet_http.py`'s floor
in front of its engines).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import uvicorn

JSON = {"content-type": "application/json"}
# A client: start it, post a body (the answer's status and its body's reads), close it.
Post = Callable[[bytes], Awaitable[tuple[int, AsyncIterator[bytes]]]]


def aiohttp_client(upstream: str) -> tuple[Callable[[], Post], Callable[[], Awaitable[None]]]:
    session: list[aiohttp.ClientSession] = []

    def start() -> Post:
        session.append(aiohttp.ClientSession())

        async def post(body: bytes) -> tuple[int, AsyncIterator[bytes]]:
            resp = await session[0].post(upstream + "/chat/completions", data=body, headers=JSON)
            return resp.status, resp.content.iter_any()

        return post

    async def close() -> None:
        await session[0].close()

    return start, close


def http1_client(upstream: str) -> tuple[Callable[[], Post], Callable[[], Awaitable[None]]]:
    from gateway.upstreams.http1 import Http1Pool

    pools: list[Http1Pool] = []

    def start() -> Post:
        pools.append(Http1Pool(upstream))

        async def post(body: bytes) -> tuple[int, AsyncIterator[bytes]]:
            resp = await pools[0].post("/chat/completions", JSON, body)
            return resp.status, resp.content.iter_any()

        return post

    async def close() -> None:
        await pools[0].aclose()

    return start, close


def make_app(upstreams: str, client: str = "aiohttp"):
    make = http1_client if client == "http1" else aiohttp_client
    clients = [make(upstream) for upstream in upstreams.split(",")]
    posts: list[Post] = []
    turn = itertools.count()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    posts.extend(start() for start, _ in clients)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    for _, close in clients:
                        await close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/readyz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, chunks = await posts[next(turn) % len(posts)](body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


if __name__ == "__main__":
    uvicorn.run(
        make_app(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "aiohttp"),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
    )
