"""The `gemini` upstream kind (Google AI Studio), and the Gemini wire that `vertex` shares.

`POST {base}/v1beta/models/{model}:streamGenerateContent?alt=sse` (`:generateContent` when not
streaming) with the route's key in `x-goog-api-key`. Translation is pure and lives in
`gateway.translation.gemini`; this module does the HTTP: the model id becomes a path segment
only after a strict check, Google's error bodies become OpenAI's (with the status they imply
and RetryInfo's delay as Retry-After), and the SSE stream, which has no end event of its own,
is read to the connection's end.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.paths import PassPath
from gateway.sse import DONE, SSEEvent, encode_data
from gateway.translation.gemini import (
    GeminiStreamTranslator,
    TranslationError,
    error_to_openai,
    to_gemini_request,
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
from gateway.upstreams.http import RemoteUpstream, UpstreamHttp, json_object_body
from gateway.upstreams.translated_stream import TranslatedEventStream

log = logging.getLogger("firsttoken.upstream")

GEMINI_BASE_URL = "https://generativelanguage.googleapis.com"
# A model id as a URL path segment: no '/', '?', '#', ':' or '%', no '..', nothing else odd.
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
REDACTED = "[redacted]"


def model_segment(model: str) -> str:
    """`model` when it is safe as one path segment, else a 400 (it is client input)."""
    if not MODEL_ID.fullmatch(model) or ".." in model:
        raise client_error(
            f"model id {model[:64]!r} is not a valid model name for this route", "model"
        )
    return model


def gemini_paths(prefix: str, model: str) -> tuple[str, str]:
    """The stream and whole-answer paths of `model` under `prefix` (its publisher's path)."""
    segment = model_segment(model)
    return (
        f"{prefix}/models/{segment}:streamGenerateContent?alt=sse",
        f"{prefix}/models/{segment}:generateContent",
    )


def gemini_payload(body: dict, ctx: CallContext, route: Route) -> bytes:
    """The `generateContent` body, or a 400 naming the field that cannot be translated."""
    if ctx.endpoint != "chat":
        raise client_error(
            f"the {route.kind} route kind serves /v1/chat/completions only, not /v1/completions",
            "model",
        )
    try:
        translated = to_gemini_request(body)
    except TranslationError as exc:
        raise client_error(str(exc), exc.param) from None
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        log.warning("untranslatable request for route %s: %s", route.name, type(exc).__name__)
        raise client_error(
            f"the request cannot be translated for a Gemini model ({type(exc).__name__})"
        ) from None
    return encode_body(translated)


def google_upstream_error(exc: UpstreamError, secrets: tuple[str, ...] = ()) -> UpstreamError:
    """`exc` (an error answer) with Google's body made OpenAI's, its status the one Google's
    `status` implies, and RetryInfo's delay as the Retry-After it did not send as a header.
    Any of `secrets` the message echoes is blanked."""
    if exc.body is None:
        return exc
    status, payload, retry_after = error_to_openai(exc.status, exc.body)
    message = payload["error"]["message"]
    for secret in secrets:
        if secret:
            message = message.replace(secret, REDACTED)
    payload["error"]["message"] = message
    exc.status = status
    exc.retryable = status >= 500 or status == 429
    exc.body = orjson.dumps(payload)
    exc.content_type = "application/json"
    if retry_after is not None and exc.retry_after is None:
        exc.retry_after = retry_after
        exc.headers = [*(exc.headers or ()), (b"retry-after", str(math.ceil(retry_after)).encode())]
    return exc


class GeminiCall:
    """One model's exchange over the Gemini wire, for `gemini` and for `vertex`'s Google
    models alike: which paths, which extra headers (a fresh bearer, for Vertex)."""

    def __init__(
        self,
        http: UpstreamHttp,
        route: Route,
        paths: tuple[str, str],
        max_event_bytes: int,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.http = http
        self.route = route
        self.stream_path, self.whole_path = paths
        self.max_event_bytes = max_event_bytes
        self.secrets = secrets

    async def _post(self, path: str, payload: bytes, extra: Mapping[str, str]) -> UpstreamResponse:
        try:
            return await self.http.post(path, payload, extra)
        except UpstreamError as exc:
            raise google_upstream_error(exc, self.secrets) from None

    async def open_stream(
        self, body: dict, ctx: CallContext, extra: Mapping[str, str]
    ) -> GeminiEventStream:
        payload = gemini_payload(body, ctx, self.route)
        resp = await self._post(self.stream_path, payload, extra)
        self.http.expect(resp, stream=True)
        translator = GeminiStreamTranslator(
            ctx.client_model or ctx.upstream_model,
            request_id=f"chatcmpl-{ctx.request_id}",
            created=int(time.time()),
        )
        return GeminiEventStream(resp, translator, self.max_event_bytes, self.route.name)

    async def complete(self, body: dict, ctx: CallContext, extra: Mapping[str, str]) -> Completed:
        payload = gemini_payload(body, ctx, self.route)
        resp = await self._post(self.whole_path, payload, extra)
        self.http.expect(resp, stream=False)
        parsed = json_object_body(await self.http.read_body(resp), self.route.name)
        try:
            out = to_openai_response(
                parsed,
                ctx.client_model or ctx.upstream_model,
                request_id=f"chatcmpl-{ctx.request_id}",
                created=int(time.time()),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UpstreamError(
                "upstream sent a malformed Gemini response", status=502, retryable=False
            ) from None
        return Completed(
            200,
            orjson.dumps(out),
            "application/json",
            out["usage"],
            relayed_headers(resp.raw_headers),
        )


class GeminiUpstream(RemoteUpstream):
    """OpenAI-format requests to the Gemini API (AI Studio), and its answers back."""

    def __init__(self, route: Route, *, api_key: str | None, **options: Any) -> None:
        """`options`: those of `RemoteUpstream` (pool size, timeouts, byte limits)."""
        if not route.base_url:
            route = route.model_copy(update={"base_url": GEMINI_BASE_URL})
        super().__init__(route, {"x-goog-api-key": api_key} if api_key else {}, **options)
        self._secrets = (api_key,) if api_key else ()

    async def model_cards(self) -> list[ModelCard]:
        return []  # Gemini lists models at its own path, in its own shape; routes name them

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        raise no_forward(self.route)

    def _call(self, ctx: CallContext) -> GeminiCall:
        paths = gemini_paths("/v1beta", ctx.upstream_model)
        return GeminiCall(self.http, self.route, paths, self.max_event_bytes, self._secrets)

    async def open_stream(self, body: dict, ctx: CallContext) -> GeminiEventStream:
        return await self._call(ctx).open_stream(body, ctx, {})

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        return await self._call(ctx).complete(body, ctx, {})


class GeminiEventStream(TranslatedEventStream):
    """Gemini SSE (`data: {GenerateContentResponse}` per event) -> OpenAI chunks. Usage always
    comes out last (the proxy strips it when the client did not ask), then `[DONE]`.

    The stream ends at the connection's end: after a finish reason that is the answer's end;
    before one, or at an `{"error": ...}` event, an event that is not a JSON object or one past
    `max_event_bytes`, it ends with an error event."""

    def __init__(
        self,
        resp: UpstreamResponse,
        translator: GeminiStreamTranslator,
        max_event_bytes: int,
        route: str,
    ) -> None:
        super().__init__(resp, max_event_bytes, route)
        self._translator = translator

    def _finish(self, out: list[OutEvent], ended: bool) -> list[OutEvent]:
        if ended:
            return out
        if not self._translator.finished:
            out.append(self._error("the upstream stream ended before a finish reason"))
            return out
        usage = self._translator.usage_chunk()
        if usage is not None:
            out.append(OutEvent.of_chunk(usage))
        out.append(OutEvent(DONE, done=True))
        return out

    def _translate(self, events: list[SSEEvent]) -> tuple[list[OutEvent], bool]:
        """OpenAI events for these Gemini events, and whether the stream failed."""
        out: list[OutEvent] = []
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
            if "error" in data and "candidates" not in data:
                _, payload, _ = error_to_openai(500, event.data)
                out.append(OutEvent(encode_data(payload), error=True, chunk=payload))
                return out, True
            try:
                chunks = self._translator.feed(data)
            except (AttributeError, TypeError, ValueError, KeyError):
                out.append(self._error("the upstream sent a malformed event"))
                return out, True
            out.extend(OutEvent.of_chunk(c) for c in chunks)
        return out, False
