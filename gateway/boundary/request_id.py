"""Request ids: every answer carries an `x-request-id` a client can quote and an operator can
find in the logs (the upstream's own when it sent one, else the request's).

A request's id is the client's own `x-request-id` when it is well-formed (at most
MAX_CLIENT_ID_CHARS of letters, digits and `-_.:+/=`, as Envoy keeps a client's id), so that a
client's tracing reads through the gateway; anything else is replaced by the gateway's. The
gateway's own id (`own`) is kept beside it for what must be unique, like the id that pairs a
request's prefill and decode steps on vLLM: a client never chooses that one.
"""

from __future__ import annotations

import itertools
import os
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.upstreams.base import REQUEST_ID_HEADER

_REQUEST_IDS = itertools.count()
_PROCESS_TAG = os.urandom(4).hex()


MAX_CLIENT_ID_CHARS = 128
_CLIENT_ID = re.compile(rf"[A-Za-z0-9._:+/=-]{{1,{MAX_CLIENT_ID_CHARS}}}")


def next_request_id() -> str:
    """Unique per process and cheap (no syscall per request, unlike uuid4)."""
    return f"req_{_PROCESS_TAG}{next(_REQUEST_IDS):x}"


def client_request_id(value: str | None) -> str | None:
    """The client's `x-request-id` when it is well-formed, else None (the gateway names it)."""
    if value is None or not _CLIENT_ID.fullmatch(value):
        return None
    return value


def request_id_from(headers: Headers) -> str:
    """The id an answer to a request with `headers` names: the client's, else a new one."""
    return client_request_id(headers.get("x-request-id")) or next_request_id()


class RequestIdMiddleware:
    """Adds the request's `x-request-id` to an answer that has none (the chat and completions
    hot path sets its own and does not pass through here)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == REQUEST_ID_HEADER for name, _ in headers):
                    named = request_id_from(Headers(scope=scope))
                    headers.append((REQUEST_ID_HEADER, named.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
