"""The `vertex` upstream kind: Google Vertex AI, for Anthropic's Claude models and Google's own.

Both go to `{base}/v1/projects/{project}/locations/{region}/publishers/{publisher}/models/
{model}:{method}` with `Authorization: Bearer <token>`, the token from Application Default
Credentials (`google_token`, refreshed in the background). By model:

- `claude-*`: publisher `anthropic`, `:streamRawPredict` / `:rawPredict`, Anthropic's Messages
  body with `anthropic_version: vertex-2023-10-16` and no `model` (it is in the URL); the
  chat translation and the stream reader are the `anthropic` kind's. The Messages door sends
  Messages bodies through `forward`, adjusted the same way, so Anthropic SDK clients keep
  their `cache_control` and everything else they sent.
- every other model: publisher `google`, `:streamGenerateContent?alt=sse` /
  `:generateContent`, the `gemini` kind's translation and stream reader.

Vertex answers errors in Google's shape (quota, permissions, unknown model) or, for a Claude
model's own refusal of a request, in Anthropic's; both become OpenAI's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.paths import PassPath
from gateway.translation.anthropic import error_to_openai
from gateway.translation.gemini import google_error
from gateway.upstreams.anthropic import (
    AnthropicEventStream,
    anthropic_completed,
    anthropic_stream,
    messages_body,
)
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EventStream,
    ModelCard,
    UpstreamError,
    UpstreamResponse,
    encode_body,
    no_forward,
)
from gateway.upstreams.gemini import GeminiCall, gemini_paths, google_upstream_error, model_segment
from gateway.upstreams.google_token import DEFAULT_MARGIN_S, GoogleTokenSource, TokenUnavailable
from gateway.upstreams.http import RemoteUpstream

log = logging.getLogger("firsttoken.upstream")

VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
# The Messages door's paths (after `/v1`) that `forward` serves, and Vertex's name for each.
FORWARDED_PATHS = {("messages",): None, ("messages", "count_tokens"): "count-tokens"}


def vertex_base_url(region: str) -> str:
    """Vertex's regional endpoint, or the global one for `global`."""
    if region == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{region}-aiplatform.googleapis.com"


def is_anthropic_model(model: str) -> bool:
    """Claude models are Anthropic's on Vertex (publisher `anthropic`); all else is Google's."""
    return model.startswith("claude")


def vertex_messages_body(body: dict) -> dict:
    """A Messages body as Vertex takes it: its model goes in the URL, its version in the body."""
    out = {k: v for k, v in body.items() if k != "model"}
    out["anthropic_version"] = VERTEX_ANTHROPIC_VERSION
    return out


class VertexUpstream(RemoteUpstream):
    """OpenAI-format requests to Claude or Gemini models on Vertex AI, and their answers back."""

    def __init__(
        self,
        route: Route,
        *,
        credentials_file: str | None,
        token_margin_s: float = DEFAULT_MARGIN_S,
        **options: Any,
    ) -> None:
        """`credentials_file`: GOOGLE_APPLICATION_CREDENTIALS as the settings read it (None:
        ADC's own search, the metadata server included). `options`: `RemoteUpstream`'s."""
        assert route.project is not None and route.region is not None  # the route checked them
        if not route.base_url:
            route = route.model_copy(update={"base_url": vertex_base_url(route.region)})
        super().__init__(route, {}, **options)
        self.tokens = GoogleTokenSource(credentials_file, margin_s=token_margin_s)
        self._publishers = f"/v1/projects/{route.project}/locations/{route.region}/publishers"

    async def start(self) -> None:
        await super().start()
        await self.tokens.start()

    async def aclose(self) -> None:
        await self.tokens.aclose()
        await super().aclose()

    async def model_cards(self) -> list[ModelCard]:
        return []

    async def _auth(self) -> tuple[dict[str, str], str]:
        try:
            token = await self.tokens.token()
        except TokenUnavailable as exc:
            raise UpstreamError(f"route {self.route.name!r}: {exc}", status=503) from None
        return {"authorization": f"Bearer {token}"}, token

    def _anthropic_path(self, model: str, stream: bool) -> str:
        method = "streamRawPredict" if stream else "rawPredict"
        return f"{self._publishers}/anthropic/models/{model_segment(model)}:{method}"

    async def _post_claude(
        self, body: dict, ctx: CallContext, stream: bool
    ) -> tuple[UpstreamResponse, str | None]:
        """The Claude request and the name of its structured-answer tool (None without one)."""
        translated, answer = messages_body({**body, "stream": stream}, ctx, self.route)
        payload = encode_body(vertex_messages_body(translated))
        path = self._anthropic_path(ctx.upstream_model, stream)
        headers, token = await self._auth()
        headers.update((k, v) for k, v in ctx.forward_headers.items() if k == "anthropic-beta")
        try:
            return await self.http.post(path, payload, headers), answer
        except UpstreamError as exc:
            raise vertex_error(exc, token) from None

    def _gemini(self, ctx: CallContext, token: str) -> GeminiCall:
        paths = gemini_paths(f"{self._publishers}/google", ctx.upstream_model)
        return GeminiCall(self.http, self.route, paths, self.max_event_bytes, (token,))

    async def open_stream(self, body: dict, ctx: CallContext) -> EventStream:
        if is_anthropic_model(ctx.upstream_model):
            resp, answer = await self._post_claude(body, ctx, stream=True)
            self.http.expect(resp, stream=True)
            stream: AnthropicEventStream = anthropic_stream(
                resp, ctx, self.max_event_bytes, self.route, answer
            )
            return stream
        headers, token = await self._auth()
        return await self._gemini(ctx, token).open_stream(body, ctx, headers)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        if is_anthropic_model(ctx.upstream_model):
            resp, answer = await self._post_claude(body, ctx, stream=False)
            self.http.expect(resp, stream=False)
            raw = await self.http.read_body(resp)
            return anthropic_completed(raw, resp, ctx, self.route, answer)
        headers, token = await self._auth()
        return await self._gemini(ctx, token).complete(body, ctx, headers)

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """A Messages API request (the Messages door's native path) for a Claude model, its
        body adjusted for Vertex; its answer is Anthropic's own, relayed as it comes."""
        if method != "POST" or path.segments not in FORWARDED_PATHS or path.query:
            raise no_forward(self.route)
        try:
            body = orjson.loads(data)
        except (orjson.JSONDecodeError, TypeError):
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not is_anthropic_model(model):
            raise no_forward(self.route)
        count_name = FORWARDED_PATHS[path.segments]
        if count_name is None:
            url_path = self._anthropic_path(model, body.get("stream") is True)
            payload = vertex_messages_body(body)
        else:  # count_tokens: Vertex's count-tokens model takes the model in the body
            url_path = f"{self._publishers}/anthropic/models/{count_name}:rawPredict"
            payload = {**body, "anthropic_version": VERTEX_ANTHROPIC_VERSION}
        auth, token = await self._auth()
        if "anthropic-beta" in headers:
            auth["anthropic-beta"] = headers["anthropic-beta"]
        out = self.http.headers(auth)  # the route's own headers too, the bearer last
        try:
            resp = await self.http.session.post(
                self.http.base_url + url_path,
                data=orjson.dumps(payload),
                headers=out,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(
                f"Upstream {self.route.name!r} unreachable ({type(exc).__name__}).", status=503
            ) from None
        if 400 <= resp.status < 500:
            raise await self._client_error(resp, token)
        return resp

    async def _client_error(self, resp: aiohttp.ClientResponse, token: str) -> UpstreamError:
        """A 4xx for the Messages door: Google's error or Anthropic's, read within the limit,
        as a status and message that the door answers in Anthropic's shape."""
        status = resp.status
        body = await self.http.read_body(resp)
        google = google_error(body)
        if google is not None:
            message = str(google.get("message") or f"upstream answered {status}")
        else:
            message = str(error_to_openai(status, body)["error"]["message"])
        return UpstreamError(message.replace(token, "[redacted]"), status=status, retryable=False)


def vertex_error(exc: UpstreamError, token: str) -> UpstreamError:
    """A Claude model's error answer on Vertex: Google's shape (quota, permission, unknown
    model) or Anthropic's (the model's own refusal), made OpenAI's either way."""
    if exc.body is None:
        return exc
    if google_error(exc.body) is not None:
        return google_upstream_error(exc, (token,))
    exc.body = orjson.dumps(error_to_openai(exc.status, exc.body))
    exc.content_type = "application/json"
    return exc
