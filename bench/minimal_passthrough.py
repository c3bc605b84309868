"""The floor for any Python streaming proxy on this harness: a bare ASGI app that forwards a
chat request to the upstream and relays the response bytes, nothing else (no routing, policies,
telemetry or SSE parsing). `gateway_overhead.py` runs it beside the gateway twice: with
aiohttp's client, and with the gateway's own (`gateway.upstreams.http1`), so that what the
client costs is measured in the same run.

    python bench/minimal_passthrough.py PORT UPSTREAM_BASE_URL [aiohttp|http1]
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn


def make_http1_app(upstream: str):
    from gateway.upstreams.http1 import Http1Pool

    state: dict[str, Http1Pool] = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["pool"] = Http1Pool(upstream)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await state["pool"].aclose()
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
        resp = await state["pool"].post(
            "/chat/completions", {"content-type": "application/json"}, body
        )
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        async for chunk in resp.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def make_app(upstream: str):
    state: dict[str, aiohttp.ClientSession] = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["session"] = aiohttp.ClientSession()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await state["session"].close()
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
        async with state["session"].post(
            upstream + "/chat/completions", data=body, headers={"content-type": "application/json"}
        ) as resp:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


if __name__ == "__main__":
    client = sys.argv[3] if len(sys.argv) > 3 else "aiohttp"
    uvicorn.run(
        (make_http1_app if client == "http1" else make_app)(sys.argv[2]),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
    )
