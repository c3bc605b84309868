"""A client that leaves cancels the work done for it.

The raw ASGI exchanges (passthrough, the Messages and Responses doors) run the whole upstream
exchange in the task that serves the request. Once the request body is read, the only message
`receive` can still deliver is `http.disconnect`; waiting for it beside the exchange and
cancelling the task when it comes closes the upstream connection at once, so a departed
client never keeps an upstream generating (and billing) for nobody.

The gateway's own server (`gateway.run.server`) resolves a future in the request's scope, under
`DISCONNECT_EXTENSION`, when the connection is lost: waiting on it costs no task and no
`receive` call per request (an ASGI extension: `{"future": ...}`). Under any other ASGI
server the wait is a task reading `receive`.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope

DISCONNECT_EXTENSION = "firsttoken.disconnect"


def disconnect_waiter(scope: Scope, receive: Receive) -> asyncio.Future:
    """A future that completes when the client disconnects; cancel it when no longer needed.
    Use it only once the request body has been read."""
    extension = (scope.get("extensions") or {}).get(DISCONNECT_EXTENSION)
    gone = extension.get("future") if extension else None
    if gone is not None and not gone.cancelled():
        return gone
    return asyncio.ensure_future(wait_for_disconnect(receive))


async def wait_for_disconnect(receive: Receive) -> None:
    await asyncio.sleep(0)  # let the upstream request go out first (see report_headers)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """Cancels the current task when the client disconnects, until `stop()`.

    Use: `start(scope, receive)` once the body is read; in the task's `except CancelledError`,
    `absorbed()` tells whether the cancel was ours (then the task is uncancelled and the
    exchange ends quietly) or someone else's (re-raise); `stop()` in `finally`.
    """

    def __init__(self) -> None:
        self.gone = False
        self._stopped = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Future | None = None

    def start(self, scope: Scope, receive: Receive) -> None:
        if self._watcher is None and not self._stopped:
            self._watcher = disconnect_waiter(scope, receive)
            self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future) -> None:
        if self._stopped or watcher.cancelled() or watcher.exception() is not None:
            return
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    def absorbed(self) -> bool:
        """True when the cancellation in flight is this watch's own (the client left)."""
        if not self.gone or self._task is None:
            return False
        self._task.uncancel()
        return True

    def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
