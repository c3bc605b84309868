"""Forwarding one chat or completions request: retries before the first byte, streaming after.

`StreamRelay` is a raw ASGI response so that the moment the status line goes out is ours to
choose: an upstream failure before any event can still become a 502/503/504 (or a fallback),
while every event after the first is written the moment it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, sse_error_event
from gateway.prepared import PreparedRequest
from gateway.routes import Route
from gateway.settings import Settings
from gateway.sse import DONE, KEEPALIVE, SSE_RAW_HEADERS
from gateway.timing import RequestTiming
from gateway.upstreams.base import (
    CallContext,
    Completed,
    OutEvent,
    Upstream,
    UpstreamBody,
    UpstreamError,
    UpstreamTimeout,
    has_request_id,
)

log = logging.getLogger("firsttoken.proxy")
T = TypeVar("T")

BACKOFF_S = (0.05, 0.2, 0.5, 1.0)


class Proxy:
    def __init__(self, settings: Settings, upstreams: dict[str, Upstream]) -> None:
        self.settings = settings
        self.upstreams = upstreams

    def _context(self, plan: PreparedRequest, body: UpstreamBody) -> CallContext:
        return CallContext(
            plan.endpoint,
            plan.tenant,
            body.get("model", ""),
            plan.request_id,
            plan.forward_headers,
            plan.model,
        )

    def first_token_timeout(self, route: Route) -> float | None:
        return route.first_token_timeout_s or self.settings.first_token_timeout_s

    def timeout(self, route: Route) -> float:
        return route.timeout_s or self.settings.timeout_s

    async def attempt(
        self,
        plan: PreparedRequest,
        timing: RequestTiming,
        call: Callable[[Upstream, UpstreamBody, CallContext, Route], Awaitable[T]],
    ) -> tuple[T, Route]:
        """Run `call` on the route chain: retry on retryable errors, then fall back, all before
        the client has seen a byte. Honours Retry-After when it fits in the route's budget.
        Returns what `call` returned and the route that answered."""
        last: UpstreamError | None = None
        for position, route in enumerate(plan.chain):
            upstream = self.upstreams[route.name]
            body = plan.body_for(route)
            ctx = self._context(plan, body)
            budget_end = time.perf_counter() + self.timeout(route)
            for attempt in range(self.settings.retry_attempts):
                timing.route, timing.fallback = route.name, position > 0
                timing.upstream_sent = time.perf_counter()
                try:
                    return await call(upstream, body, ctx, route), route
                except UpstreamError as exc:
                    last = exc
                    if not exc.retryable:
                        raise
                    delay = (
                        exc.retry_after
                        if exc.retry_after is not None
                        else BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                    )
                    if attempt + 1 >= self.settings.retry_attempts:
                        break
                    if time.perf_counter() + delay >= budget_end:
                        break
                    log.info(
                        "request %s: retrying route %s after %s in %.2fs",
                        plan.request_id,
                        route.name,
                        exc.status,
                        delay,
                    )
                    await asyncio.sleep(delay)
        assert last is not None
        raise last

    async def complete(
        self, plan: PreparedRequest, timing: RequestTiming, receive: Receive
    ) -> Response:
        """A non-streaming request; if the client leaves first, the upstream request is closed
        at once instead of paying for an answer nobody will read."""

        async def call(
            upstream: Upstream, body: UpstreamBody, ctx: CallContext, route: Route
        ) -> Completed:
            try:
                return await asyncio.wait_for(upstream.complete(body, ctx), self.timeout(route))
            except TimeoutError:
                raise UpstreamTimeout(f"upstream {route.name!r} timed out") from None
            except UpstreamError:
                raise
            except Exception as exc:  # noqa: BLE001  # e.g. a body cut short: retried like a 5xx
                raise UpstreamError(
                    f"upstream {route.name!r} failed ({type(exc).__name__})"
                ) from None

        work = asyncio.ensure_future(self.attempt(plan, timing, call))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled() or not work.done():
            try:
                await work
            except BaseException:  # noqa: BLE001  # cancelled for a client that left: no one reads it
                pass
            timing.status = "client_gone"
            plan.finish(timing)
            return Response(status_code=499)  # nobody is there to read it
        try:
            result, _ = work.result()
        except UpstreamError as exc:
            timing.status = _status_kind(exc)
            plan.finish(timing)
            _log_failure(plan, exc)
            return upstream_error_response(exc, plan)
        timing.usage = result.usage
        headers = await plan.headers()
        plan.finish(timing)
        response = Response(
            result.body,
            status_code=result.status,
            media_type=None,
            headers={"content-type": result.content_type, **headers},
        )
        response.raw_headers.extend(upstream_headers(plan, result.headers))
        return response

    def stream(self, plan: PreparedRequest, timing: RequestTiming) -> StreamRelay:
        return StreamRelay(self, plan, timing)


class StreamRelay:
    """ASGI response that relays upstream SSE events to the client as they arrive.

    Whatever the upstream does, the client's stream ends the same way: a finish or an error
    event, then `data: [DONE]`, and nothing after it."""

    def __init__(self, proxy: Proxy, plan: PreparedRequest, timing: RequestTiming) -> None:
        self.proxy = proxy
        self.plan = plan
        self.timing = timing
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in this task (no extra hop before the upstream request goes out); a
        # watcher cancels it the moment the client disconnects, which closes the upstream.
        relay_task = asyncio.current_task()
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
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
            self.plan.finish(self.timing)

    def _on_disconnect(self, watcher: asyncio.Future, relay_task: asyncio.Task | None) -> None:
        if self.finished or watcher.cancelled() or watcher.exception() is not None:
            return
        self.client_gone = True
        self.timing.status = "client_gone"
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
                *upstream_headers(self.plan, self._relayed),
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
        await self._write(send, KEEPALIVE)
        self._arm_keepalive(send)

    def _stop_keepalives(self) -> None:
        self._keepalives_stopped = True
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()

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
        plan, timing = self.plan, self.timing
        try:
            (stream, iterator, first), route = await self.proxy.attempt(
                plan, timing, lambda u, b, c, r: self._open_and_first(u, b, c, r, send)
            )
        except UpstreamError as exc:
            timing.status = _status_kind(exc)
            _log_failure(plan, exc)
            if not self.started:
                response = upstream_error_response(exc, plan)
                await response({"type": "http"}, _no_receive, send)
            else:
                await self._end(send, sse_error_event(exc.message, _error_type(exc)) + DONE)
            return

        # The route's whole-request budget counts from when the answering attempt was sent.
        deadline = (timing.upstream_sent or time.perf_counter()) + self.proxy.timeout(route)
        try:
            await self._start(send)
            async with asyncio.timeout(deadline - time.perf_counter()):
                if not await self._forward(send, first):
                    async for batch in iterator:
                        if await self._forward(send, batch):
                            await _close_iterator(iterator)  # nothing after [DONE] is read
                            break
        except TimeoutError:
            timing.status = "timeout"
            tail = self._failed(sse_error_event("upstream timed out mid-stream", "timeout_error"))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001  # any break mid-stream ends it with an error event
            log.warning(
                "request %s: stream from route %s failed: %s",
                plan.request_id,
                timing.route,
                type(exc).__name__,
            )
            timing.status = "upstream_error"
            message = (
                exc.message
                if isinstance(exc, UpstreamError)
                else (f"upstream stream from route {timing.route!r} failed ({type(exc).__name__})")
            )
            tail = self._failed(sse_error_event(message))
        else:
            tail = self._ending()
        finally:
            await stream.aclose()
        await self._end(send, tail)

    async def _end(self, send: Send, tail: bytes) -> None:
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _failed(self, error_event: bytes) -> bytes:
        """What a failure adds to the stream: an error event and [DONE], unless [DONE] is out."""
        return b"" if self.saw_done else error_event + DONE

    def _ending(self) -> bytes:
        """What the upstream's stream lacked at its end: a [DONE], and an error event before
        it when the answer did not finish (the upstream closed mid-answer) or was malformed."""
        if self.saw_done:
            return b""
        if self.saw_malformed:
            self.timing.status = "upstream_error"
            return (
                sse_error_event(
                    f"upstream stream from route {self.timing.route!r} sent a malformed event"
                )
                + DONE
            )
        if not (self.saw_finish or self.saw_error):
            self.timing.status = "upstream_error"
            return (
                sse_error_event(
                    f"upstream stream from route {self.timing.route!r} ended before it finished"
                )
                + DONE
            )
        return DONE

    async def _forward(self, send: Send, batch: list[OutEvent]) -> bool:
        """Write a batch of events at once; read them for telemetry after the write, except
        an event that may be the usage chunk the client did not ask for. True when the stream
        is over: [DONE] went out, or an event turned out malformed."""
        timing = self.timing
        arrived = time.perf_counter()
        keep_usage = self.plan.client_wants_usage
        parts = []
        for event in batch:
            if not keep_usage and event.is_usage_only():
                continue
            parts.append(event.raw)
        if parts:
            await self._write(send, parts[0] if len(parts) == 1 else b"".join(parts))
        written = time.perf_counter()
        content = over = False
        for event in batch:
            event.resolve()
            if event.usage is not None:
                timing.usage = event.usage
            if event.content:
                content = True
            if event.finish:  # may come with the last content
                self.saw_finish = True
            elif event.error:
                timing.status = "upstream_error"
                self.saw_error = True
            elif event.done:
                self.saw_done = over = True
            elif event.malformed:
                self.saw_malformed = over = True
        if content:
            timing.content_arrived(arrived, written)
        return over


async def _wait_for_disconnect(receive: Receive) -> None:
    await asyncio.sleep(0)  # let the upstream request go out first (see report_headers)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


async def _close_iterator(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def upstream_headers(
    plan: PreparedRequest, relayed: list[tuple[bytes, bytes]] | None
) -> list[tuple[bytes, bytes]]:
    """The upstream's relayed headers, plus the gateway's own `x-request-id` when the upstream
    sent none: every answer names a request id the client can quote."""
    if has_request_id(relayed):
        return relayed  # type: ignore[return-value]  # has_request_id: not None
    own = (b"x-request-id", plan.request_id.encode())
    return [*relayed, own] if relayed else [own]


def _log_failure(plan: PreparedRequest, exc: UpstreamError) -> None:
    """One line per request that no route could serve, with the id its client was given."""
    level = logging.INFO if _status_kind(exc) == "client_error" else logging.WARNING
    log.log(level, "request %s (tenant %s) failed: %s", plan.request_id, plan.tenant, exc.message)


def _status_kind(exc: UpstreamError) -> str:
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    return "client_error" if 400 <= exc.status < 500 and exc.status != 429 else "upstream_error"


def _error_type(exc: UpstreamError) -> str:
    return "timeout_error" if isinstance(exc, UpstreamTimeout) else "upstream_error"


def upstream_error_response(exc: UpstreamError, plan: PreparedRequest) -> Response:
    """An upstream's own 4xx passes through with its body; everything else becomes 502/503/504."""
    headers = plan.response_headers
    if 400 <= exc.status < 500 and exc.body is not None:
        response = Response(
            exc.body,
            status_code=exc.status,
            headers={"content-type": exc.content_type or "application/json", **headers},
        )
    else:
        if isinstance(exc, UpstreamTimeout):
            status = 504
        else:
            status = 503 if exc.status == 503 else 502
        error = GatewayError(status, exc.message, code="upstream_" + str(exc.status))
        response = error.to_response()
        response.headers.update(headers)
        if exc.retry_after is not None and status == 503 and not exc.headers:
            response.headers["retry-after"] = str(int(exc.retry_after))
    # The upstream's Retry-After, rate-limit and request-id headers, as it sent them.
    response.raw_headers.extend(upstream_headers(plan, exc.headers))
    return response
