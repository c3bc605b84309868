"""The `anthropic` upstream kind: OpenAI requests in, Anthropic Messages API out, and back.

Translation lives in `gateway.translation.anthropic` (pure); this module only does the HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.paths import PassPath
from gateway.sse import (
    DEFAULT_MAX_EVENT_BYTES,
    DONE,
    SSEEvent,
    encode_data,
)
from gateway.translation.anthropic import (
    AnthropicStreamError,
    AnthropicStreamTranslator,
    TranslationError,
    answer_tool,
    error_to_openai,
    to_anthropic_request,
    to_openai_response,
)
from gateway.upstreams.base import (
    CallContext,
    Completed,
    ModelCard,
    OutEvent,
    UpstreamError,
    UpstreamResponse,
    client_error,
    encode_body,
    no_forward,
    relayed_headers,
)
from gateway.upstreams.http import RemoteUpstream, json_object_body
from gateway.upstreams.translated_stream import TranslatedEventStream

log = logging.getLogger("firsttoken.upstream")

ANTHROPIC_VERSION = "2023-06-01"
# Anthropic's own paths (after the route's base URL, `.../v1`) that `forward` serves, by method;
# `*` is one object id (already validated by `parse_target`). The Files API is the passthrough
# door's (`gateway.doors.passthrough`), for clients that send `anthropic-version`.
FORWARDED_PATHS: dict[str, frozenset[tuple[str, ...]]] = {
    "POST": frozenset({("messages",), ("messages", "count_tokens"), ("files",)}),
    "GET": frozenset({("files",), ("files", "*"), ("files", "*", "content")}),
    "DELETE": frozenset({("files", "*")}),
}
# Families whose paths take a query (a list's paging; the SDK's `beta=true`); `messages` none.
QUERY_FAMILIES = frozenset({"files"})


def forwarded(method: str, path: PassPath) -> bool:
    """Whether `forward` serves this method and path (a query only where Anthropic reads one)."""
    segments = path.segments
    if not any(
        len(p) == len(segments) and all(w in ("*", s) for w, s in zip(p, segments, strict=True))
        for p in FORWARDED_PATHS.get(method, frozenset())
    ):
        return False
    return not path.query or segments[0] in QUERY_FAMILIES


class AnthropicUpstream(RemoteUpstream):
    """OpenAI-format requests to the Messages API, and its answers back in OpenAI's shape."""

    def __init__(self, route: Route, *, api_key: str | None, **options: Any) -> None:
        """`options`: those of `RemoteUpstream` (pool size, timeouts, byte limits)."""
        auth = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            auth["x-api-key"] = api_key
        super().__init__(route, auth, **options)

    async def model_cards(self) -> list[ModelCard]:
        """Anthropic's model list (`id`, `display_name`, `created_at`) as OpenAI cards."""
        return [
            {
                "id": item["id"],
                "object": "model",
                "created": _epoch(item.get("created_at")),
                "owned_by": "anthropic",
                "display_name": item.get("display_name"),
            }
            for item in await self.http.model_list()
        ]

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """Anthropic's own endpoints (`POST messages`, `POST messages/count_tokens`, the Files
        API), as the client wrote them: the Messages API door (`gateway.doors.messages`) and the
        passthrough door (files) use this. Any other path or method is not forwarded. The
        client may choose its `anthropic-version`; the route's key always replaces whatever key
        the headers carry."""
        if not forwarded(method, path):
            raise no_forward(self.route)
        return await self.http.forward(
            method, path, headers, data, client_chosen=("anthropic-version",)
        )

    def _translate(self, body: dict, ctx: CallContext) -> tuple[bytes, str | None]:
        translated, answer = messages_body(body, ctx, self.route)
        return encode_body(translated), answer

    async def _post_translated(
        self, body: dict, ctx: CallContext
    ) -> tuple[UpstreamResponse, str | None]:
        payload, answer = self._translate(body, ctx)
        extra = {k: v for k, v in ctx.forward_headers.items() if k.startswith("anthropic-")}
        try:
            return await self.http.post("/messages", payload, extra), answer
        except UpstreamError as exc:
            if exc.body is not None:
                exc.body = orjson.dumps(error_to_openai(exc.status, exc.body))
                exc.content_type = "application/json"
            raise

    async def open_stream(self, body: dict, ctx: CallContext) -> AnthropicEventStream:
        resp, answer = await self._post_translated({**body, "stream": True}, ctx)
        self.http.expect(resp, stream=True)
        return anthropic_stream(resp, ctx, self.max_event_bytes, self.route, answer)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        resp, answer = await self._post_translated({**body, "stream": False}, ctx)
        self.http.expect(resp, stream=False)
        raw = await self.http.read_body(resp)
        return anthropic_completed(raw, resp, ctx, self.route, answer)


def messages_body(body: dict, ctx: CallContext, route: Route) -> tuple[dict, str | None]:
    """The Messages body for a chat body and the name of its structured-answer tool (None
    without one), or a 400 naming the field that cannot be translated: a client's malformed
    input is never an upstream failure (502) nor retried. Shared by every kind that serves
    Anthropic models (`anthropic`, `vertex`, `bedrock`)."""
    if ctx.endpoint != "chat":
        raise client_error(
            f"the {route.kind} route kind serves /v1/chat/completions only for Anthropic "
            "models, not /v1/completions",
            "model",
        )
    try:
        translated = to_anthropic_request(body, ctx.upstream_model)
        answer = answer_tool(body)
    except TranslationError as exc:
        raise client_error(str(exc), exc.param) from None
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        # A shape the translator's checks missed; the client's body is the only input.
        log.warning("untranslatable request for route %s: %s", route.name, type(exc).__name__)
        raise client_error(
            f"the request cannot be translated for an Anthropic model ({type(exc).__name__})"
        ) from None
    return translated, answer.name if answer is not None else None


def anthropic_stream(
    resp: UpstreamResponse,
    ctx: CallContext,
    max_event_bytes: int,
    route: Route,
    answer: str | None = None,
) -> AnthropicEventStream:
    """An Anthropic SSE answer read as OpenAI chunks, usage always included; `answer`: the
    structured-answer tool whose input is the client's content."""
    translator = AnthropicStreamTranslator(
        ctx.client_model or ctx.upstream_model,
        include_usage=True,
        created=int(time.time()),
        request_id=f"chatcmpl-{ctx.request_id}",
        answer_tool=answer,
    )
    return AnthropicEventStream(resp, translator, max_event_bytes, route.name)


def anthropic_completed(
    raw: bytes,
    resp: UpstreamResponse,
    ctx: CallContext,
    route: Route,
    answer: str | None = None,
) -> Completed:
    """A whole Anthropic message as an OpenAI `chat.completion`."""
    parsed = json_object_body(raw, route.name)
    try:
        out = to_openai_response(parsed, ctx.client_model or ctx.upstream_model, answer_tool=answer)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise UpstreamError(
            "upstream sent a malformed Anthropic response", status=502, retryable=False
        ) from None
    return Completed(
        200,
        orjson.dumps(out),
        "application/json",
        out.get("usage"),
        relayed_headers(resp.raw_headers),
    )


class AnthropicEventStream(TranslatedEventStream):
    """Anthropic SSE -> OpenAI chunks. Usage is always requested from the translator, so the
    proxy learns token counts; it strips the usage chunk when the client did not ask for it.

    The stream ends at `message_stop` (then `[DONE]`; nothing after it is read) or at an error:
    an Anthropic `error` event, an event that is not a JSON object, one past `max_event_bytes`,
    or the upstream closing before `message_stop`, each of which ends with an error event."""

    def __init__(
        self,
        resp: UpstreamResponse,
        translator: AnthropicStreamTranslator,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        route: str = "anthropic",
    ) -> None:
        super().__init__(resp, max_event_bytes, route)
        self._translator = translator

    def _finish(self, out: list[OutEvent], ended: bool) -> list[OutEvent]:
        if not ended:
            out.append(self._error("the upstream stream ended before message_stop"))
        return out

    def _translate(self, events: list[SSEEvent]) -> tuple[list[OutEvent], bool]:
        """OpenAI events for these Anthropic events, and whether the stream is over."""
        out: list[OutEvent] = []
        translator = self._translator
        for event in events:
            if event.data is None:
                continue
            try:
                data = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                data = None
            if not isinstance(data, dict):
                out.append(self._error("the upstream sent an event that is not a JSON object"))
                return out, True
            name = event.event if event.event and event.event != "message" else data.get("type")
            try:
                chunks = translator.feed(name if isinstance(name, str) else "", data)
            except AnthropicStreamError as exc:  # e.g. overloaded_error mid-answer
                payload = exc.to_openai()
                out.append(OutEvent(encode_data(payload), error=True, chunk=payload))
                return out, True
            except (AttributeError, TypeError, ValueError, KeyError):
                out.append(self._error(f"the upstream sent a malformed {str(name)[:40]!r} event"))
                return out, True
            out.extend(OutEvent.of_chunk(c) for c in chunks)
            if name == "message_stop":
                out.append(OutEvent(DONE, done=True))
                return out, True
        return out, False


def _epoch(created_at: object) -> int:
    """Anthropic's RFC 3339 `created_at` as the Unix seconds of OpenAI's `created` (0 when
    absent or unreadable)."""
    if not isinstance(created_at, str):
        return 0
    try:
        return int(datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0
