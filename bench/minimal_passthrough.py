"""The floor for any Python streaming proxy on this harness: a bare ASGI app that forwards a
chat request to the upstream with aiohttp and relays the response bytes, nothing else (no
routing, policies, telemetry or SSE parsing). `gateway_overhead.py` runs it beside the gateway.

    python bench/minimal_passthrough.py PORT UPSTREAM_BASE_URL
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn


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
    uvicorn.run(
        make_app(sys.argv[2]),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
    )
