"""Writing a streamed answer's body to the client from a read callback, without ASGI's `send`.

An event relayed through `send` costs a wake-up of the request's task per upstream read, and a
walk through the coroutines between the read and the write (the upstream's reader, the event
stream, the relay, `send` itself): most of what a relayed event costs the gateway above the
bare system calls. Once the status line is out, the gateway's own server
(`gateway.run.server`) lets the relay write body bytes itself, framed as the response
started, from the upstream connection's read callback: an ASGI extension in the request's
scope, under `DIRECT_BODY_EXTENSION` (`{"writer": DirectBody}`). The response still ends
through `send`. Under any other ASGI server there is no writer, and every event goes through
`send`.
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import Scope

DIRECT_BODY_EXTENSION = "firsttoken.direct_body"


class DirectBody(Protocol):
    """The body of one response, written from any callback on the event loop."""

    def ready(self) -> bool:
        """Whether `write` may be used now: the status line went out, the response is not
        complete, the client is still there, and the body is chunked (as an event stream's
        is)."""
        ...

    def write(self, data: bytes) -> None:
        """Write `data` as the next piece of the body (nothing once the client is gone)."""
        ...

    @property
    def paused(self) -> bool:
        """The client reads slower than the gateway writes: stop feeding the writer until
        `drain` returns."""
        ...

    async def drain(self) -> None: ...


def direct_body(scope: Scope) -> DirectBody | None:
    extension = (scope.get("extensions") or {}).get(DIRECT_BODY_EXTENSION)
    return extension.get("writer") if extension else None
