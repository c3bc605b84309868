"""Relaying one upstream event stream to the client: written the moment each event arrives.

`StreamRelay` is a raw ASGI response so that the moment the status line goes out is ours to
choose: an upstream failure before any event can still become a 502/503/504 (or a fallback, by
way of `Proxy.attempt`), while every event after the first is written the moment it arrives.
Whatever the upstream does, the client's stream ends the same way: a finish or an error event,
then `data: [DONE]`, and nothing after it.

Past its first batch, a stream that can be diverted (`Diverted`: an OpenAI-compatible,
Anthropic or Gemini answer on the gateway's HTTP/1.1 client) is relayed from the upstream
connection's read callback straight into the client's (`gateway.boundary.direct_body`), where
the gateway's server offers that: each event is written, then read for telemetry, exactly as
through `send`, but no task wakes up per event. The relay waits once, for the end, under the
same deadline; a slow client pauses the upstream's reads until it has drained, as `send` would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from gateway.boundary.client_watch import disconnect_waiter
from gateway.boundary.direct_body import DirectBody, direct_body
from gateway.config.routes import Route
from gateway.pipeline.answer import CHAT, AnswerFormat
from gateway.pipeline.prepared import PreparedRequest
from gateway.pipeline.proxy import (
    Proxy,
    client_status,
    error_type,
    log_failure,
    upstream_error_response,
    upstream_headers,
)
from gateway.sse import SSE_RAW_HEADERS
from gateway.telemetry.record import RequestRecord
from gateway.upstreams.base import (
    CallContext,
    Diverted,
    EventStream,
    OutEvent,
    Upstream,
    UpstreamError,
    UpstreamTimeout,
    close_iterator,
)

log = logging.getLogger("firsttoken.proxy")


class StreamRelay:
    """ASGI response that relays upstream SSE events to the client as they arrive.

    Whatever the upstream does, the client's stream ends the same way: a finish or an error
    event, then `data: [DONE]`, and nothing after it."""

    def __init__(
        self,
        proxy: Proxy,
        plan: PreparedRequest,
        record: RequestRecord,
        answer: AnswerFormat = CHAT,
    ) -> None:
        self.proxy = proxy
        self.plan = plan
        self.record = record
        self.answer = answer
        self.started = False
        self.client_gone = False
        self.finished = False
        self.saw_done = False  # [DONE] went out
        self.saw_finish = False  # a chunk with a finish_reason went out
        self.saw_error = False  # an error event went out
        self.saw_malformed = False  # an event turned out not to be JSON after it went out
        self._relayed: list[tuple[bytes, bytes]] | None = None
        self._start_lock = asyncio.Lock()
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._keepalive_task: asyncio.Task | None = None
        self._keepalives_stopped = False
        self._writer: DirectBody | None = None  # the server's, for a diverted stream
        self._diverted: Diverted | None = None
        self._draining: asyncio.Future | None = None  # waiting for a slow client to drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in this task (no extra hop before the upstream request goes out); a
        # watcher cancels it the moment the client disconnects, which closes the upstream.
        relay_task = asyncio.current_task()
        self._writer = direct_body(scope)
        watcher = disconnect_waiter(scope, receive)
        watcher.add_done_callback(lambda w: self._on_disconnect(w, relay_task))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not self.client_gone or relay_task is None:
                raise
            relay_task.uncancel()
        finally:
            self.finished = True
            watcher.cancel()
            self.record.finish()

    def _on_disconnect(self, watcher: asyncio.Future, relay_task: asyncio.Task | None) -> None:
        if self.finished or watcher.cancelled() or watcher.exception() is not None:
            return
        self.client_gone = True
        self.record.ended_with(499)
        if relay_task is not None:
            relay_task.cancel()

    async def _start(self, send: Send) -> None:
        if self.started:
            return
        async with self._start_lock:  # the keepalive task and the relay may both get here
            if self.started:
                return
            headers = await self.plan.headers()
            raw = [
                *SSE_RAW_HEADERS,
                *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
                *upstream_headers(self.plan, self._relayed, self.answer),
                *self.answer.headers,
            ]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            self.started = True

    async def _write(self, send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    # Keepalives ride on a timer rather than a task per request: most first tokens come
    # long before the first keepalive is due, and a timer costs nothing until it fires.
    def _arm_keepalive(self, send: Send) -> None:
        if not self._keepalives_stopped:
            self._keepalive_timer = asyncio.get_running_loop().call_later(
                self.proxy.settings.keepalive_s, self._keepalive_due, send
            )

    def _keepalive_due(self, send: Send) -> None:
        self._keepalive_task = asyncio.ensure_future(self._send_keepalive(send))

    async def _send_keepalive(self, send: Send) -> None:
        await self._start(send)
        await self._write(send, self.answer.keepalive())
        self._arm_keepalive(send)

    def _stop_keepalives(self) -> None:
        self._keepalives_stopped = True
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()

    async def _first_out(
        self, upstream: Upstream, body: dict, ctx: CallContext, route: Route, send: Send
    ):
        """Open the upstream stream and write its first events, before the attempt returns: the
        client's first token does not wait for the attempt's bookkeeping. Once the upstream's
        first events are here, the attempt has succeeded, so a failure to write them is not
        the attempt's to retry: it is returned, for `_relay` to end the stream with it like any
        failure mid-stream. Returns the stream, its iterator, and whether the stream is already
        over (or that failure)."""
        stream, iterator, first = await self._open_and_first(upstream, body, ctx, route, send)
        over: bool | Exception
        try:
            await self._start(send)
            over = await self._forward(send, first)
        except Exception as exc:  # noqa: BLE001  # handed to _relay, which ends the stream
            over = exc
        except BaseException:
            await stream.aclose()
            raise
        return stream, iterator, over

    async def _open_and_first(
        self, upstream: Upstream, body: dict, ctx: CallContext, route: Route, send: Send
    ):
        """Open the upstream stream and wait for its first events while a timer sends
        keepalive comments; a first-token timeout here may still be retried (the client has
        seen no event). Under a first-token deadline the status is held back until the first
        event, so no keepalive may go out before it (a keepalive would send the 200): a
        route that never answers then still ends in a clean 504."""
        first_token_limit = self.proxy.first_token_timeout(route)
        limit = first_token_limit or self.proxy.timeout(route)
        self._keepalives_stopped = False
        if first_token_limit is None or self.started:
            self._arm_keepalive(send)
        stream = None
        try:
            async with asyncio.timeout(limit):
                stream = await upstream.open_stream(body, ctx)
                self._relayed = getattr(stream, "relayed", None)
                if first_token_limit is None:
                    # No first-token deadline to enforce with a clean 504, so the status line
                    # goes out now and the first event later travels alone, as from the
                    # provider itself. Retries stay possible: the client has seen no event.
                    await self._start(send)
                iterator = stream.__aiter__()
                try:
                    first = await iterator.__anext__()
                except StopAsyncIteration:
                    first = []
            return stream, iterator, first
        except BaseException as exc:
            if stream is not None:
                await stream.aclose()
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeout(
                    f"no first token from route {route.name!r} within {limit}s"
                ) from None
            if isinstance(exc, Exception) and not isinstance(exc, UpstreamError):
                # The stream broke before its first event (a reset, a truncated body): the
                # client has seen no event, so this may still be retried or fall back.
                raise UpstreamError(
                    f"upstream {route.name!r} failed before its first event ({type(exc).__name__})"
                ) from None
            raise
        finally:
            self._stop_keepalives()

    async def _relay(self, send: Send) -> None:
        plan, record, answer = self.plan, self.record, self.answer
        try:
            (stream, iterator, over), route = await self.proxy.attempt(
                plan, record, lambda u, b, c, r: self._first_out(u, b, c, r, send)
            )
        except UpstreamError as exc:
            record.ended_with(client_status(exc))
            log_failure(plan, exc)
            if not self.started:
                response = upstream_error_response(exc, plan, answer)
                await response({"type": "http"}, _no_receive, send)
            else:
                await self._end(send, answer.failure(exc.message, error_type(exc)))
            return

        # The route's whole-request budget counts from when the answering attempt was sent.
        deadline = (record.upstream_sent or time.perf_counter()) + self.proxy.timeout(route)
        try:
            async with asyncio.timeout(deadline - time.perf_counter()):
                if isinstance(over, Exception):
                    raise over
                if not over:
                    await self._pump(send, stream, iterator)
        except TimeoutError:
            record.status = "timeout"
            tail = self._failed("upstream timed out mid-stream", "timeout_error")
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001  # any break mid-stream ends it with an error event
            log.warning(
                "request %s: stream from route %s failed: %s",
                plan.request_id,
                record.route,
                type(exc).__name__,
            )
            record.status = "upstream_error"
            message = (
                exc.message
                if isinstance(exc, UpstreamError)
                else (f"upstream stream from route {record.route!r} failed ({type(exc).__name__})")
            )
            tail = self._failed(message)
        else:
            tail = self._ending()
        finally:
            self._undivert()
            await close_iterator(iterator)
            await stream.aclose()
        await self._end(send, tail)

    async def _pump(self, send: Send, stream: EventStream, iterator: AsyncIterator) -> None:
        """The events after the first batch, to the end of the stream: diverted into the
        client's connection where both sides allow it (as soon as they do), else batch by
        batch through `send`."""
        writer = self._writer
        divert = getattr(stream, "divert", None) if writer is not None else None
        while True:
            if divert is not None and writer is not None and writer.ready():
                diverted = divert(self._forward_now)
                if diverted is not None:
                    self._diverted = diverted
                    if writer.paused:
                        self._client_full()
                    await diverted.ended()
                    return
            try:
                batch = await iterator.__anext__()
            except StopAsyncIteration:
                return
            if await self._forward(send, batch):
                return  # nothing after [DONE] is read

    def _forward_now(self, batch: list[OutEvent]) -> bool:
        """`_forward` for a diverted stream, in the upstream's read callback: the batch goes
        straight into the client's connection."""
        writer = self._writer
        assert writer is not None
        arrived = time.perf_counter()
        data = self.answer.events(batch, self.plan.client_wants_usage)
        if data:
            writer.write(data)
            if writer.paused:
                self._client_full()
        return self._read_batch(batch, arrived, time.perf_counter())

    def _client_full(self) -> None:
        """The client reads slower than the upstream writes: no more upstream reads until its
        connection has drained (as `send` waits)."""
        diverted, writer = self._diverted, self._writer
        if diverted is None or writer is None or self._draining is not None:
            return
        diverted.pause()
        self._draining = asyncio.ensure_future(writer.drain())
        self._draining.add_done_callback(self._client_drained)

    def _client_drained(self, _: asyncio.Future) -> None:
        self._draining = None
        if self._diverted is not None:
            self._diverted.resume()

    def _undivert(self) -> None:
        diverted, self._diverted = self._diverted, None
        if diverted is not None:
            diverted.stop()
        if self._draining is not None:
            self._draining.cancel()

    async def _end(self, send: Send, tail: bytes) -> None:
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _failed(self, message: str, type: str = "upstream_error") -> bytes:
        """What a failure adds to the stream: an error event and the end, unless the end is
        out."""
        return b"" if self.saw_done else self.answer.failure(message, type)

    def _ending(self) -> bytes:
        """What the upstream's stream lacked at its end: its end marker, and an error event
        before it when the answer did not finish (the upstream closed mid-answer) or was
        malformed."""
        if self.saw_done:
            return b""
        route = self.record.route
        if self.saw_malformed:
            self.record.status = "upstream_error"
            return self.answer.failure(
                f"upstream stream from route {route!r} sent a malformed event", "upstream_error"
            )
        if not (self.saw_finish or self.saw_error):
            self.record.status = "upstream_error"
            return self.answer.failure(
                f"upstream stream from route {route!r} ended before it finished", "upstream_error"
            )
        return self.answer.done()

    async def _forward(self, send: Send, batch: list[OutEvent]) -> bool:
        """Write a batch of events at once, in the client's API; read them for telemetry after
        the write (a chat stream's events are parsed only then, except one that may be the
        usage chunk the client did not ask for). True when the stream is over: its end went
        out, or an event turned out malformed."""
        arrived = time.perf_counter()
        data = self.answer.events(batch, self.plan.client_wants_usage)
        if data:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        return self._read_batch(batch, arrived, time.perf_counter())

    def _read_batch(self, batch: list[OutEvent], arrived: float, written: float) -> bool:
        """Read a batch that went out (`arrived` from upstream, `written` to the client) for
        telemetry and the stream's end: True when the stream is over."""
        record = self.record
        content = over = False
        for event in batch:
            event.resolve()
            if event.usage is not None:
                record.usage = event.usage
            if event.content:
                content = True
            if event.finish:  # may come with the last content
                self.saw_finish = True
            elif event.error:
                record.status = "upstream_error"
                self.saw_error = True
            elif event.done:
                self.saw_done = over = True
            elif event.malformed:
                self.saw_malformed = over = True
        if content:
            record.content_arrived(arrived, written)
        return over


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}
