"""The `bedrock` upstream kind: OpenAI requests to the Amazon Bedrock runtime, signed with SigV4.

Claude models (`anthropic.*`, `us.anthropic.*`, an inference-profile ARN naming one) go through
InvokeModel with Anthropic's own Messages body (`anthropic_version: bedrock-2023-05-31`, no
`model`: the id is in the path), translated by `gateway.translation.anthropic` as for an
`anthropic` route; every other model goes through Converse (`gateway.translation`'s
`chat_to_converse` / `converse_to_chat`). Streams arrive in AWS event-stream framing
(`bedrock_stream`). The transport is the gateway's own aiohttp session; botocore only signs
(`aws_auth`) and parses frames, and is imported only when a bedrock route is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from yarl import URL

from gateway.config.routes import Route
from gateway.paths import PassPath
from gateway.translation.anthropic import (
    AnthropicStreamTranslator,
    TranslationError,
    answer_tool,
    to_anthropic_request,
)
from gateway.translation.anthropic import to_openai_response as anthropic_to_openai
from gateway.translation.chat_to_converse import to_converse_request
from gateway.translation.converse_to_chat import ConverseStreamTranslator
from gateway.translation.converse_to_chat import to_openai_response as converse_to_openai
from gateway.upstreams.base import (
    CallContext,
    Completed,
    ModelCard,
    UpstreamError,
    client_error,
    encode_body,
    has_request_id,
    no_forward,
    relayed_headers,
    retry_after_seconds,
)
from gateway.upstreams.bedrock_stream import (
    AnthropicChunks,
    BedrockEventStream,
    ChunkSource,
    ConverseChunks,
    MessageReader,
    MessagesSSE,
)
from gateway.upstreams.bedrock_wire import (
    ANTHROPIC_VERSION,
    EVENT_STREAM,
    bedrock_error,
    is_anthropic_model,
    model_path,
)
from gateway.upstreams.http import RemoteUpstream, json_object_body, read_limited

if TYPE_CHECKING:
    from gateway.upstreams.aws_auth import AwsSigner

log = logging.getLogger("firsttoken.upstream")

ERROR_BODY_MAX_BYTES = 64 * 1024
WARM_UP_TIMEOUT_S = 5.0
AWS_REQUEST_ID = b"x-amzn-requestid"


def default_base_url(region: str) -> str:
    return f"https://bedrock-runtime.{region}.amazonaws.com"


def bedrock_anthropic_body(body: dict, beta: str | None = None) -> dict:
    """An Anthropic Messages body as InvokeModel takes it: `anthropic_version` first, no
    `model` or `stream` (the path says both), beta flags in the body (`anthropic_beta`), the
    rest as it was."""
    out: dict[str, Any] = {"anthropic_version": body.get("anthropic_version") or ANTHROPIC_VERSION}
    out.update((k, v) for k, v in body.items() if k not in ("model", "stream", "anthropic_version"))
    flags = [flag.strip() for flag in (beta or "").split(",") if flag.strip()]
    if flags and "anthropic_beta" not in out:
        out["anthropic_beta"] = flags
    return out


class BedrockUpstream(RemoteUpstream):
    """Chat requests to Bedrock (InvokeModel for Claude, Converse for the rest), and Messages
    requests for Claude, as the Messages door's native path (`messages`)."""

    def __init__(self, route: Route, **options: Any) -> None:
        """`options`: those of `RemoteUpstream` (pool size, timeouts, byte limits)."""
        from gateway.upstreams.aws_auth import AwsSigner

        region = route.region
        assert region is not None  # the route's validation requires it
        if route.base_url is None:
            route = route.model_copy(update={"base_url": default_base_url(region)})
        super().__init__(route, {}, **options)
        self.signer: AwsSigner = AwsSigner(region)

    async def start(self) -> None:
        await super().start()
        await self.signer.start()

    async def warm_up(self) -> None:
        """Open a keep-alive connection (an unsigned GET of `/`; its answer is not read)."""
        await self.http.get_origin_text("/", WARM_UP_TIMEOUT_S, 4096)

    async def model_cards(self) -> list[ModelCard]:
        """The route's own model names (those without wildcards): Bedrock's model list is
        another service's (`bedrock`, not `bedrock-runtime`)."""
        return [
            {"id": name, "object": "model", "created": 0, "owned_by": self.route.name}
            for name in self.route.models
            if not any(c in name for c in "*?[")
        ]

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        raise no_forward(self.route)

    # -- chat --------------------------------------------------------------------------------

    def _chat_body(self, body: dict, ctx: CallContext) -> tuple[bool, bytes, str | None]:
        """Whether the model is Claude, the body for its API and, for Claude, the name of the
        structured-answer tool (None without one); a 400 for what cannot be translated."""
        if ctx.endpoint != "chat":
            raise client_error(
                "the bedrock route kind serves /v1/chat/completions only, not /v1/completions",
                "model",
            )
        claude = is_anthropic_model(ctx.upstream_model)
        answer = None
        try:
            if claude:
                translated = to_anthropic_request(body, ctx.upstream_model)
                tool = answer_tool(body)
                answer = tool.name if tool is not None else None
                translated.pop("metadata", None)  # InvokeModel takes no `metadata`
                beta = ctx.forward_headers.get("anthropic-beta")
                out = bedrock_anthropic_body(translated, beta)
            else:
                out = to_converse_request(body)
        except TranslationError as exc:
            raise client_error(str(exc), exc.param) from None
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            log.warning(
                "untranslatable request for route %s: %s", self.route.name, type(exc).__name__
            )
            raise client_error(
                f"the request cannot be translated for Bedrock ({type(exc).__name__})"
            ) from None
        return claude, encode_body(out), answer

    async def open_stream(self, body: dict, ctx: CallContext) -> BedrockEventStream:
        claude, payload, answer = self._chat_body(body, ctx)
        action = "invoke-with-response-stream" if claude else "converse-stream"
        resp = await self.post(model_path(ctx.upstream_model, action), payload, stream=True)
        model = ctx.client_model or ctx.upstream_model
        created, request_id = int(time.time()), f"chatcmpl-{ctx.request_id}"
        source: ChunkSource
        if claude:
            source = AnthropicChunks(
                AnthropicStreamTranslator(
                    model,
                    include_usage=True,
                    created=created,
                    request_id=request_id,
                    answer_tool=answer,
                )
            )
        else:
            source = ConverseChunks(
                ConverseStreamTranslator(model, created=created, request_id=request_id)
            )
        reader = MessageReader(resp, self.max_event_bytes)
        stream = BedrockEventStream(reader, source, self.route.name, self.relayed(resp, False))
        try:
            await stream.open()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        claude, payload, answer = self._chat_body(body, ctx)
        action = "invoke" if claude else "converse"
        resp = await self.post(model_path(ctx.upstream_model, action), payload, stream=False)
        parsed = json_object_body(await self.http.read_body(resp), self.route.name)
        model = ctx.client_model or ctx.upstream_model
        try:
            out = (
                anthropic_to_openai(parsed, model, answer_tool=answer)
                if claude
                else converse_to_openai(parsed, model)
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UpstreamError(
                f"route {self.route.name!r}: Bedrock sent a malformed response",
                status=502,
                retryable=False,
            ) from None
        return Completed(
            200, orjson.dumps(out), "application/json", out.get("usage"), self.relayed(resp, False)
        )

    # -- the Messages door -------------------------------------------------------------------

    async def messages(
        self, data: bytes, headers: Mapping[str, str], stream: bool
    ) -> aiohttp.ClientResponse | MessagesSSE:
        """A Messages API body (its `model` the Bedrock id) sent to InvokeModel: a whole answer
        as Bedrock's JSON response (Anthropic's message), a stream as `MessagesSSE`, opened up
        to its first content. Failures before that are `UpstreamError`s."""
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise client_error("the request body is not JSON") from None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not is_anthropic_model(model):
            raise client_error("the Messages API serves Claude models on Bedrock", "model")
        payload = encode_body(bedrock_anthropic_body(body, headers.get("anthropic-beta")))
        action = "invoke-with-response-stream" if stream else "invoke"
        resp = await self.post(model_path(model, action), payload, stream=stream)
        if not stream:
            return resp
        answer = MessagesSSE(MessageReader(resp, self.max_event_bytes), self.route.name)
        try:
            await answer.open()
        except BaseException:
            answer.close()
            raise
        return answer

    # -- HTTP ----------------------------------------------------------------------------------

    async def post(self, path: str, payload: bytes, *, stream: bool) -> aiohttp.ClientResponse:
        """A signed POST to the route's origin; an error status is raised as the
        `UpstreamError` its Bedrock exception maps to, a wrong media type as a 502."""
        url = self.http.base_url + path
        accept = EVENT_STREAM if stream else "application/json"
        headers = {
            **self.route.headers,
            "content-type": "application/json",
            "accept": accept,
            "accept-encoding": "identity",
        }
        signed = await self.signer.sign(url, payload, headers)
        try:
            resp = await self.http.session.post(
                URL(url, encoded=True), data=payload, headers=signed, allow_redirects=False
            )
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError(
                f"upstream {self.route.name!r} unreachable ({type(exc).__name__})", status=503
            ) from None
        if resp.status >= 400:
            raise await self._error(resp)
        if resp.status >= 300:
            raise await self.http.status_error(resp)  # a redirect: never followed
        if resp.content_type != accept:
            resp.close()
            raise UpstreamError(
                f"upstream {self.route.name!r} answered {resp.content_type[:64]!r} where "
                f"{accept} was expected",
                status=502,
            )
        return resp

    async def _error(self, resp: aiohttp.ClientResponse) -> UpstreamError:
        try:
            payload = await read_limited(resp, ERROR_BODY_MAX_BYTES)
        except Exception:  # noqa: BLE001  # too large or cut: the status still tells
            payload = b""
        finally:
            resp.release()
        return bedrock_error(
            self.route.name,
            resp.status,
            resp.headers.get("x-amzn-errortype"),
            payload,
            retry_after=retry_after_seconds(resp.headers.get("retry-after")),
            headers=self.relayed(resp, True),
        )

    @staticmethod
    def relayed(resp: aiohttp.ClientResponse, retry: bool) -> list[tuple[bytes, bytes]] | None:
        """The relayed headers, Bedrock's request id (`x-amzn-requestid`) as `x-request-id`."""
        out = relayed_headers(resp.raw_headers, retry=retry)
        for name, value in resp.raw_headers if not has_request_id(out) else ():
            if name.lower() == AWS_REQUEST_ID:
                out = [*(out or []), (b"x-request-id", value)]
                break
        return out
