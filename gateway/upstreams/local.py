"""The `local` upstream kind: the bundled engine, in process.

`engine_backend` (and torch) are imported only here and only when a local route exists, so a
gateway in front of remote APIs never pays for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config.routes import Route
from gateway.sse import DONE
from gateway.upstreams.base import (
    CallContext,
    Completed,
    ModelCard,
    OutEvent,
    UpstreamBody,
    UpstreamError,
    client_error,
    no_forward,
)

if TYPE_CHECKING:
    import aiohttp

    from engine_backend import LocalEngine
    from gateway.paths import PassPath

log = logging.getLogger(__name__)


class LocalUpstream:
    """A route served by the bundled engine, loaded on `start()` (in a worker thread: loading
    weights takes seconds and must not stall the event loop)."""

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
        self.device = device
        self.dtype = dtype
        self.isolate_tenants = isolate_tenants
        self.max_num_batched_tokens = max_num_batched_tokens  # None: the engine's own default
        self.local_engine: LocalEngine | None = None

    async def start(self) -> None:
        if self.local_engine is not None:
            return
        from engine_backend import LocalEngine  # heavy: torch

        path = self.route.model_path
        local_engine = await asyncio.to_thread(
            LocalEngine.from_model,
            path,
            demo=self.route.demo or not path,
            isolate_tenants=self.isolate_tenants,
            device=self.device,
            dtype=self.dtype,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        await local_engine.start()
        self.local_engine = local_engine

    async def warm_up(self) -> None:
        """Nothing beyond `start()`: the model is loaded and its thread runs by then."""

    async def aclose(self) -> None:
        if self.local_engine is not None:
            await self.local_engine.aclose()
            self.local_engine = None

    async def model_cards(self) -> list[ModelCard]:
        return self.local_engine.model_cards() if self.local_engine is not None else []

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        raise no_forward(self.route)

    def _running(self) -> LocalEngine:
        if self.local_engine is None:
            raise UpstreamError(f"local engine {self.route.name!r} is not started", status=503)
        return self.local_engine

    def _engine_error(self, exc: Exception) -> UpstreamError:
        """A bad request is the client's 400; an engine that stopped is a 503 (retryable, so a
        fallback route may serve it, only when the engine thread is gone for good: a step that
        failed may have failed on this very request). Anything else failed this request alone
        inside the engine and is never retried: a retry would replay it onto every tenant's
        engine."""
        from engine_backend import EngineClosedError, EngineRequestError

        if isinstance(exc, EngineRequestError):
            return client_error(exc.message, exc.param)
        if isinstance(exc, EngineClosedError):
            running = self.local_engine is not None and self.local_engine.thread.is_running
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

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> LocalEventStream:
        from engine_backend.openai_response import ENDPOINTS

        local_engine = self._running()
        options = body.get("stream_options")
        if options is None or isinstance(options, dict):  # anything else: the engine's 400
            options = {**(options or {}), "include_usage": True}
        body = {**body, "model": ctx.client_model or ctx.upstream_model, "stream_options": options}
        chunks = local_engine.stream(body, endpoint=ENDPOINTS[ctx.endpoint], tenant=ctx.tenant)
        try:
            first: dict | None = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 -- every engine failure becomes an UpstreamError
            raise self._engine_error(exc) from None
        return LocalEventStream(chunks, first, self.route.name)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        from engine_backend.openai_response import ENDPOINTS

        local_engine = self._running()
        body = {**body, "model": ctx.client_model or ctx.upstream_model}
        try:
            out = await local_engine.complete(
                body, endpoint=ENDPOINTS[ctx.endpoint], tenant=ctx.tenant
            )
        except Exception as exc:  # noqa: BLE001 -- every engine failure becomes an UpstreamError
            raise self._engine_error(exc) from None
        return Completed(200, orjson.dumps(out), "application/json", out.get("usage"))


class LocalEventStream:
    """Engine chunk dicts -> SSE events; the first chunk was pulled early to surface request errors.
    A failure after that ends this stream with an error event and [DONE], never a retry."""

    relayed: list[tuple[bytes, bytes]] | None = None  # no provider headers to pass on

    def __init__(
        self, chunks: AsyncGenerator[dict, None], first: dict | None, route: str = ""
    ) -> None:
        self._chunks = chunks
        self._first = first
        self._route = route

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        if self._first is not None:
            yield [OutEvent.of_chunk(self._first)]
            self._first = None
        try:
            async for chunk in self._chunks:
                yield [OutEvent.of_chunk(chunk)]
        except Exception as exc:  # noqa: BLE001 -- output has started: report in-stream
            log.warning(
                "route %s: stream failed in the engine: %s", self._route, type(exc).__name__
            )
            message = f"local engine {self._route!r} failed on this request ({_reason(exc)})"
            yield [OutEvent.failure(message), OutEvent(DONE, done=True)]
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
