"""Forwarding one chat or completions request along its route chain.

`Proxy.attempt` retries and falls back, all before the client has seen a byte; `Proxy.complete`
answers a non-streaming request whole, and `stream_relay.StreamRelay` a streaming one as its
events arrive. Upstream failures become OpenAI-shaped answers here, with the upstream's
rate-limit and request-id headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope

from gateway.boundary.client_watch import disconnect_waiter
from gateway.config.routes import Route
from gateway.config.settings import Settings
from gateway.errors import GatewayError, openai_error_from_upstream
from gateway.pipeline.answer import CHAT, AnswerFormat
from gateway.pipeline.prepared import PreparedRequest
from gateway.telemetry.record import RequestRecord, status_class
from gateway.upstreams.base import (
    CallContext,
    Completed,
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
            plan.own_id or plan.request_id,  # unique: a pd route pairs its steps on it
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
        record: RequestRecord,
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
                record.route, record.fallback = route.name, position > 0
                record.upstream_sent = time.perf_counter()
                try:
                    result = await call(upstream, body, ctx, route)
                    record.hedged = ctx.hedged
                    return result, route
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
        self,
        plan: PreparedRequest,
        record: RequestRecord,
        scope: Scope,
        receive: Receive,
        answer: AnswerFormat = CHAT,
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

        work = asyncio.ensure_future(self.attempt(plan, record, call))
        watcher = disconnect_waiter(scope, receive)
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
            record.ended_with(499)
            record.finish()
            return Response(status_code=499)  # nobody is there to read it
        try:
            result, _ = work.result()
        except UpstreamError as exc:
            response = upstream_error_response(exc, plan, answer)
            record.ended_with(client_status(exc))
            record.finish()
            log_failure(plan, exc)
            return response
        record.usage = result.usage
        headers = await plan.headers()
        record.finish()
        response = Response(
            answer.whole(result.status, result.body),
            status_code=result.status,
            media_type=None,
            headers={"content-type": result.content_type, **headers},
        )
        response.raw_headers.extend(upstream_headers(plan, result.headers, answer))
        response.raw_headers.extend(answer.headers)
        return response


def upstream_headers(
    plan: PreparedRequest,
    relayed: list[tuple[bytes, bytes]] | None,
    answer: AnswerFormat = CHAT,
) -> list[tuple[bytes, bytes]]:
    """The upstream's relayed headers, plus the request's own `x-request-id` when the upstream
    sent none: every answer names a request id the client can quote, under each name the
    client's API reads (`answer.request_id_names`)."""
    if has_request_id(relayed):
        out: list[tuple[bytes, bytes]] = relayed  # type: ignore[assignment]  # not None
    else:
        own = (b"x-request-id", plan.request_id.encode())
        out = [*relayed, own] if relayed else [own]
    if answer.request_id_names:
        named = next(value for name, value in out if name == b"x-request-id")
        out = [*out, *((name, named) for name in answer.request_id_names)]
    return out


def log_failure(plan: PreparedRequest, exc: UpstreamError) -> None:
    """One line per request that no route could serve, with the id its client was given."""
    level = logging.INFO if status_class(client_status(exc)) == "client_error" else logging.WARNING
    log.log(level, "request %s (tenant %s) failed: %s", plan.request_id, plan.tenant, exc.message)


def client_status(exc: UpstreamError) -> int:
    """The status the client gets for `exc` (see `upstream_error_response`)."""
    if isinstance(exc, UpstreamTimeout):
        return 504
    if 400 <= exc.status < 500 and exc.body is not None:
        return exc.status
    return 503 if exc.status == 503 else 502


def error_type(exc: UpstreamError) -> str:
    return "timeout_error" if isinstance(exc, UpstreamTimeout) else "upstream_error"


def upstream_error_response(
    exc: UpstreamError, plan: PreparedRequest, answer: AnswerFormat = CHAT
) -> Response:
    """An upstream's own 4xx passes through with its message, in OpenAI's error shape (its
    body was read only up to ERROR_BODY_BYTES); everything else becomes 502/503/504. The body
    is in the client's API (`answer`)."""
    headers = plan.response_headers
    status = client_status(exc)
    if 400 <= exc.status < 500 and exc.body is not None:
        body = openai_error_from_upstream(exc.status, exc.body)
        response = Response(
            answer.whole(status, body),
            status_code=status,
            headers={"content-type": "application/json", **headers},
        )
    else:
        error = GatewayError(status, exc.message, code="upstream_" + str(exc.status))
        response = Response(
            answer.whole(status, orjson.dumps(error.to_dict())),
            status_code=status,
            media_type="application/json",
        )
        response.headers.update(headers)
        if exc.retry_after is not None and status == 503 and not exc.headers:
            response.headers["retry-after"] = str(int(exc.retry_after))
    # The upstream's Retry-After, rate-limit and request-id headers, as it sent them.
    response.raw_headers.extend(upstream_headers(plan, exc.headers, answer))
    response.raw_headers.extend(answer.headers)
    return response
