"""The `local` upstream kind: the bundled engine, in process.

`engine_backend` (and torch) are imported only here and only when a local route exists, so a
gateway in front of remote APIs never pays for them.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson

from gateway.routes import Route
from gateway.sse import DONE, encode_data
from gateway.upstreams.base import (CallContext, Completed, OutEvent, UpstreamError,
                                    chunk_has_content)


class LocalUpstream:
    def __init__(self, route: Route, *, device: str | None = None, dtype: str | None = None,
                 isolate_tenants: bool = False, max_num_batched_tokens: int | None = None) -> None:
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
        self.engine = await asyncio.to_thread(LocalEngine.from_model, path, demo=demo, **self._options)
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
        param = getattr(exc, "param", None)
        body = orjson.dumps({"error": {"message": str(exc), "type": "invalid_request_error",
                                       "param": param, "code": None}})
        return UpstreamError(str(exc), status=400, retryable=False, body=body,
                             content_type="application/json")

    async def open_stream(self, body: dict, ctx: CallContext) -> "LocalEventStream":
        from engine_backend import EngineRequestError

        body = {**body, "model": ctx.upstream_model,
                "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        make = (self.engine.chat_completion_stream if ctx.endpoint == "chat"
                else self.engine.completion_stream)
        chunks = make(body, tenant=ctx.tenant)
        try:
            first = await chunks.__anext__()
        except EngineRequestError as exc:
            raise self._engine_error(exc) from None
        except StopAsyncIteration:
            first = None
        return LocalEventStream(chunks, first)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        from engine_backend import EngineRequestError

        body = {**body, "model": ctx.upstream_model}
        make = self.engine.chat_completion if ctx.endpoint == "chat" else self.engine.completion
        try:
            out = await make(body, tenant=ctx.tenant)
        except EngineRequestError as exc:
            raise self._engine_error(exc) from None
        return Completed(200, orjson.dumps(out), "application/json", out.get("usage"))


class LocalEventStream:
    """Engine chunk dicts -> SSE events; the first chunk was pulled early to surface request errors."""

    def __init__(self, chunks: AsyncIterator[dict], first: dict | None) -> None:
        self._chunks = chunks
        self._first = first

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        if self._first is not None:
            yield [_event(self._first)]
            self._first = None
        async for chunk in self._chunks:
            yield [_event(chunk)]
        yield [OutEvent(DONE, done=True)]

    async def aclose(self) -> None:
        await self._chunks.aclose()


def _event(chunk: dict) -> OutEvent:
    usage = chunk.get("usage")
    return OutEvent(encode_data(chunk), content=chunk_has_content(chunk), usage=usage,
                    usage_only=usage is not None and not chunk.get("choices"))
