"""The `local` upstream kind: the bundled engine, in process.

`engine_backend` (and torch) are imported only here and only when a local route exists, so a
gateway in front of remote APIs never pays for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.errors import sse_error_event
from gateway.routes import Route
from gateway.sse import DONE, encode_data
from gateway.upstreams.base import (
    CallContext,
    Completed,
    OutEvent,
    UpstreamError,
    chunk_has_content,
)

log = logging.getLogger(__name__)


class LocalUpstream:
    def __init__(
        self,
        route: Route,
        *,
        device: str | None = None,
        dtype: str | None = None,
        isolate_tenants: bool = False,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.route = route
        self._options = {"device": device, "dtype": dtype, "isolate_tenants": isolate_tenants}
        if max_num_batched_tokens:
            self._options["max_num_batched_tokens"] = max_num_batched_tokens
        self.engine: Any = None
        self.warm = False

    async def start(self) -> None:
        if self.engine is not None:
            return
        from engine_backend import LocalEngine  # heavy: torch

        path, demo = self.route.model_path, self.route.demo or not self.route.model_path
        self.engine = await asyncio.to_thread(
            LocalEngine.from_model, path, demo=demo, **self._options
        )
        await self.engine.start()
        self.warm = True

    async def warm_up(self) -> None:
        self.warm = self.engine is not None

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None

    def model_cards(self) -> list[dict]:
        return self.engine.model_cards() if self.engine is not None else []

    def _engine_error(self, exc: Exception) -> UpstreamError:
        """A bad request is the client's 400; an engine that stopped is a 503 (retryable, so a
        fallback route may serve it, only when the engine thread is gone for good: a step that
        failed may have failed on this very request). Anything else failed this request alone
        inside the engine and is never retried: a retry would replay it onto every tenant's
        engine."""
        from engine_backend import EngineClosedError, EngineRequestError

        if isinstance(exc, EngineRequestError):
            body = orjson.dumps(
                {
                    "error": {
                        "message": exc.message,
                        "type": "invalid_request_error",
                        "param": exc.param,
                        "code": None,
                    }
                }
            )
            return UpstreamError(
                exc.message, status=400, retryable=False, body=body, content_type="application/json"
            )
        if isinstance(exc, EngineClosedError):
            running = self.engine is not None and self.engine.async_engine.is_running
            return UpstreamError(
                f"local engine {self.route.name!r} stopped", status=503, retryable=not running
            )
        log.warning(
            "route %s: request failed in the engine: %s", self.route.name, type(exc).__name__
        )
        return UpstreamError(
            f"local engine {self.route.name!r} failed on this request ({_reason(exc)})",
            status=500,
            retryable=False,
        )

    async def open_stream(self, body: dict, ctx: CallContext) -> LocalEventStream:
        options = body.get("stream_options")
        if options is None or isinstance(options, dict):  # anything else: the engine's 400
            options = {**(options or {}), "include_usage": True}
        body = {**body, "model": ctx.upstream_model, "stream_options": options}
        make = (
            self.engine.chat_completion_stream
            if ctx.endpoint == "chat"
            else self.engine.completion_stream
        )
        chunks = make(body, tenant=ctx.tenant)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            raise self._engine_error(exc) from None
        return LocalEventStream(chunks, first, self.route.name)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        body = {**body, "model": ctx.upstream_model}
        make = self.engine.chat_completion if ctx.endpoint == "chat" else self.engine.completion
        try:
            out = await make(body, tenant=ctx.tenant)
        except Exception as exc:
            raise self._engine_error(exc) from None
        return Completed(200, orjson.dumps(out), "application/json", out.get("usage"))


class LocalEventStream:
    """Engine chunk dicts -> SSE events; the first chunk was pulled early to surface request errors.
    A failure after that ends this stream with an error event and [DONE], never a retry."""

    relayed = None  # no provider headers to pass on

    def __init__(self, chunks: AsyncIterator[dict], first: dict | None, route: str = "") -> None:
        self._chunks = chunks
        self._first = first
        self._route = route

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        if self._first is not None:
            yield [_event(self._first)]
            self._first = None
        try:
            async for chunk in self._chunks:
                yield [_event(chunk)]
        except Exception as exc:
            log.warning(
                "route %s: stream failed in the engine: %s", self._route, type(exc).__name__
            )
            message = f"local engine {self._route!r} failed on this request ({_reason(exc)})"
            yield [OutEvent(sse_error_event(message), error=True), OutEvent(DONE, done=True)]
            return
        yield [OutEvent(DONE, done=True)]

    async def aclose(self) -> None:
        await self._chunks.aclose()


def _reason(exc: Exception) -> str:
    """What the client may read: a request failure carries a message the engine wrote for it;
    anything else (a failed step's text may describe the machine) shows its kind only."""
    from engine_backend import EngineClosedError, RequestFailedError

    if isinstance(exc, RequestFailedError):
        return str(exc)
    if isinstance(exc, EngineClosedError):
        return "the engine stopped"
    return type(exc).__name__


def _event(chunk: dict) -> OutEvent:
    usage = chunk.get("usage")
    return OutEvent(
        encode_data(chunk),
        content=chunk_has_content(chunk),
        usage=usage,
        usage_only=usage is not None and not chunk.get("choices"),
    )
