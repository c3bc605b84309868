"""The `anthropic` upstream kind: OpenAI requests in, Anthropic Messages API out, and back.

Translation lives in `anthropic_format` (pure); this module only does the HTTP.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

import aiohttp
import orjson

from gateway.sse import SSEParser, encode_data
from gateway.upstreams.anthropic_format import (AnthropicStreamError, AnthropicStreamTranslator,
                                                TranslationError, error_to_openai,
                                                to_anthropic_request, to_openai_response)
from gateway.upstreams.base import (CallContext, Completed, OutEvent, UpstreamError,
                                    chunk_has_content)
from gateway.upstreams.openai import OpenAIUpstream

ANTHROPIC_VERSION = "2023-06-01"


class AnthropicUpstream(OpenAIUpstream):
    """Reuses the pooled session and error handling of the OpenAI kind; differs in headers and shape."""

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"content-type": "application/json", "anthropic-version": ANTHROPIC_VERSION,
                   **self.route.headers}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        if extra:
            headers.update({k: v for k, v in extra.items() if k.startswith("anthropic-")})
        return headers

    def card(self, item: dict) -> dict:
        """Anthropic's model object ({id, display_name, created_at, type}) as an OpenAI card."""
        return {"id": item["id"], "object": "model", "created": 0, "owned_by": "anthropic",
                "display_name": item.get("display_name")}

    def _translate(self, body: dict, ctx: CallContext) -> bytes:
        if ctx.endpoint != "chat":
            raise UpstreamError("the anthropic route kind serves /v1/chat/completions only",
                                status=400, retryable=False)
        try:
            return orjson.dumps(to_anthropic_request(body, ctx.upstream_model))
        except TranslationError as exc:
            raise UpstreamError(str(exc), status=400, retryable=False,
                                body=orjson.dumps({"error": {"message": str(exc),
                                                             "type": "invalid_request_error",
                                                             "param": exc.param, "code": None}}),
                                content_type="application/json") from None

    async def _post_translated(self, body: dict, ctx: CallContext) -> aiohttp.ClientResponse:
        payload = self._translate(body, ctx)
        try:
            return await self._post("/messages", payload, ctx)
        except UpstreamError as exc:
            if exc.body is not None:
                exc.body = orjson.dumps(error_to_openai(exc.status, exc.body))
                exc.content_type = "application/json"
            raise

    async def open_stream(self, body: dict, ctx: CallContext) -> "AnthropicEventStream":
        resp = await self._post_translated({**body, "stream": True}, ctx)
        translator = AnthropicStreamTranslator(ctx.upstream_model, include_usage=True,
                                               created=int(time.time()), request_id=f"chatcmpl-{ctx.request_id}")
        return AnthropicEventStream(resp, translator)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        resp = await self._post_translated({**body, "stream": False}, ctx)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        try:
            out = to_openai_response(orjson.loads(raw), ctx.upstream_model)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise UpstreamError("upstream sent a malformed Anthropic response", status=502,
                                retryable=False) from None
        return Completed(200, orjson.dumps(out), "application/json", out.get("usage"))


class AnthropicEventStream:
    """Anthropic SSE -> OpenAI chunks. Usage is always requested from the translator, so the
    proxy learns token counts; it strips the usage chunk when the client did not ask for it."""

    def __init__(self, resp: aiohttp.ClientResponse, translator: AnthropicStreamTranslator) -> None:
        self._resp = resp
        self._translator = translator

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        parser = SSEParser()
        translator = self._translator
        async for chunk in self._resp.content.iter_any():
            out: list[OutEvent] = []
            for event in parser.feed(chunk):
                if event.data is None:
                    continue
                try:
                    data = orjson.loads(event.data)
                except orjson.JSONDecodeError:
                    continue
                name = event.event or (data.get("type") if isinstance(data, dict) else None)
                try:
                    chunks = translator.feed(name or "", data)
                except AnthropicStreamError as exc:  # e.g. overloaded_error mid-answer
                    out.append(OutEvent(encode_data(exc.to_openai()), error=True))
                    continue
                for c in chunks:
                    usage = c.get("usage")
                    out.append(OutEvent(encode_data(c), content=chunk_has_content(c), usage=usage,
                                        usage_only=usage is not None and not c.get("choices")))
                if name == "message_stop":
                    out.append(OutEvent(b"data: [DONE]\n\n", done=True))
            if out:
                yield out

    async def aclose(self) -> None:
        if not self._resp.closed:
            self._resp.close()


