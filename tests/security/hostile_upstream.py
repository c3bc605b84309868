"""A hostile upstream for the adversarial suite: an aiohttp server on loopback whose answer to
every request is whatever the test scripts.

A test sets `upstream.handler` to one of the answer factories below (or its own coroutine)
and reads back what the gateway sent (`requests`) and whether the gateway hung up on it
(`disconnects`). Every path and method lands in the same handler, so a test sees anything the
gateway sends, wherever it sends it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from bench.mock_openai import ThreadedServer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HostileUpstream:
    """Records each request, then runs `handler` (on the server's own loop)."""

    def __init__(self, handler: Handler | None = None) -> None:
        self.handler: Handler = handler or sse_answer(openai_stream("hello"))
        # GET /models (the gateway's warm-up and model list) answers at once unless scripted,
        # so that a hanging `handler` does not hold the gateway's start-up.
        self.models_handler: Handler = json_answer(
            {
                "object": "list",
                "data": [{"id": "gpt-hostile", "object": "model", "created": 0, "owned_by": "h"}],
            }
        )
        self.requests: list[dict] = []  # {"method", "path", "headers", "body"}
        self.disconnects: list[float] = []  # when a write failed: the gateway closed on us
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self._dispatch)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        handler = self.handler
        if request.method == "GET" and request.path.endswith("/models"):
            handler = self.models_handler
        try:
            return await handler(request)
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self.disconnects.append(time.perf_counter())
            raise

    def posts(self) -> list[dict]:
        """The requests that carried a prompt (not the warm-up's GETs)."""
        return [r for r in self.requests if r["method"] == "POST"]


class HostileServer(ThreadedServer):
    """`HostileUpstream` running in a background thread: `with HostileServer() as s: ...`."""

    def __init__(self, handler: Handler | None = None) -> None:
        super().__init__(HostileUpstream(handler))  # type: ignore[arg-type]

    @property
    def upstream(self) -> HostileUpstream:
        return self.mock  # type: ignore[return-value]

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# --- OpenAI and Anthropic payloads ----------------------------------------------------------


def chunk(
    content: str | None = None, finish: str | None = None, usage: object = None, **extra: object
) -> bytes:
    """One OpenAI chat.completion.chunk event."""
    delta = {} if content is None else {"content": content}
    body: dict = {
        "id": "chatcmpl-h",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    if usage is not None:
        body = {**body, "choices": [], "usage": usage}
    return b"data: " + orjson.dumps(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def pieces(text: str) -> list[str]:
    """`text` cut after each space, as a model streams it: "a b" -> ["a ", "b"]."""
    return re.split(r"(?<= )", text)


def openai_stream(text: str, *, usage: object = None, done: bool = True) -> list[bytes]:
    """A well-formed stream: role, one content chunk per word, finish, usage, [DONE]."""
    events = [chunk("")]
    events += [chunk(piece) for piece in pieces(text)]
    events.append(chunk(finish="stop"))
    if usage is not None:
        events.append(chunk(usage=usage))
    if done:
        events.append(DONE)
    return events


def completion(text: str = "hello", usage: object = None) -> dict:
    return {
        "id": "chatcmpl-h",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": usage
        if usage is not None
        else {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def anthropic_event(name: str, data: dict) -> bytes:
    return f"event: {name}\n".encode() + b"data: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def anthropic_stream(text: str, *, stop: bool = True) -> list[bytes]:
    usage = {"input_tokens": 5, "output_tokens": 1}
    events = [
        anthropic_event(
            "message_start",
            {
                "message": {
                    "id": "msg_h",
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [],
                    "usage": usage,
                }
            },
        ),
        anthropic_event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        ),
    ]
    events += [
        anthropic_event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}}
        )
        for piece in pieces(text)
    ]
    events += [
        anthropic_event("content_block_stop", {"index": 0}),
        anthropic_event(
            "message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}
        ),
    ]
    if stop:
        events.append(anthropic_event("message_stop", {}))
    return events


# --- answers ------------------------------------------------------------------------------


def sse_answer(
    events: list[bytes],
    *,
    content_type: str = "text/event-stream",
    headers: dict[str, str] | None = None,
    then: str = "close",
    gap_s: float = 0.0,
) -> Handler:
    """Write `events` (raw bytes, framing is the test's business), then `close` the body
    cleanly, `hang` until the client leaves, or `reset` the connection."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": content_type, **(headers or {})})
        await resp.prepare(request)
        for i, event in enumerate(events):
            if i and gap_s:
                await asyncio.sleep(gap_s)
            await resp.write(event)
        if then == "hang":
            await hang_until_gone(request)
        elif then == "reset":
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    return handler


def json_answer(
    payload: object,
    *,
    status: int = 200,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
) -> Handler:
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            body=raw, status=status, headers={"content-type": content_type, **(headers or {})}
        )

    return handler


def redirect_answer(location: str, status: int = 307) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"location": location})

    return handler


def endless_answer(
    first: bytes,
    filler: bytes,
    total_bytes: int,
    content_type: str = "text/event-stream",
    length: int | None = None,
) -> Handler:
    """`first`, then `filler` repeated up to `total_bytes` (never held in memory at once):
    an unterminated event, or a body far past any sane size. `length` sets Content-Length."""

    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {"content-type": content_type}
        resp = web.StreamResponse(headers=headers)
        if length is not None:
            resp.content_length = length
        await resp.prepare(request)
        await resp.write(first)
        sent = len(first)
        while sent < total_bytes:
            await resp.write(filler)
            sent += len(filler)
        await resp.write_eof()
        return resp

    return handler


async def hang_until_gone(request: web.Request, limit_s: float = 30.0) -> None:
    """Hold the response open until the client closes its side (or `limit_s` passes)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client went away")
        await asyncio.sleep(0.01)
