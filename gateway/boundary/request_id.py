"""Request ids: every answer carries an `x-request-id` a client can quote and an operator can
find in the logs (the upstream's own when it sent one, else the gateway's)."""

from __future__ import annotations

import itertools
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.upstreams.base import REQUEST_ID_HEADER

_REQUEST_IDS = itertools.count()
_PROCESS_TAG = os.urandom(4).hex()


def next_request_id() -> str:
    """Unique per process and cheap (no syscall per request, unlike uuid4)."""
    return f"req_{_PROCESS_TAG}{next(_REQUEST_IDS):x}"


class RequestIdMiddleware:
    """Adds the gateway's `x-request-id` to an answer that has none (the chat and completions
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
                    headers.append((REQUEST_ID_HEADER, next_request_id().encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
