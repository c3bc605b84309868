"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API as a door,
so that an application holding the `anthropic` SDK points its `base_url` at the gateway.

The request is routed by its `model` like chat's:

- to an `anthropic` route, or a Claude model on a `vertex` or `bedrock` route
  (`speaks_messages`), it goes
  in Anthropic's own format, through the route's policies
  applied to the Messages shape (`cache_hints` adds breakpoints only where the client set none),
  else byte for byte unless the route's `model_map` renames the model, so the client's
  `cache_control` and everything else it sent arrive as sent;
- to any other route (`openai`, `local`, `gemini`, a Gemini model on `vertex`, a non-Claude
  model on `bedrock`) it is translated to chat (`gateway.translation`) and served by
  the chat path (policies, retries, fallbacks, TTFT), the answer translated back as it streams;
  `count_tokens` there is an estimate that says so (`x-firsttoken-estimate`).

The exchange with an `anthropic` route keeps the guarantees of the chat path:

- the tenant comes from its key (`x-api-key` or `Authorization: Bearer`), which never goes
  upstream; the route's key does, to the route's own origin only (`Upstream.forward`);
- the body is bounded like chat's (bytes, JSON containers and depth, `model`, `messages`);
- only `anthropic-version` (default 2023-06-01) and `anthropic-beta` of the client's headers
  are forwarded;
- the route's timeout bounds the whole exchange, and a client that leaves closes the upstream
  request at once;
- the answer is relayed within limits, in Anthropic's shapes (`messages_relay`);
- each `messages` request is recorded in telemetry once, with its TTFT and usage.

On a `bedrock` route the exchange is the same, with the route's SigV4-signed InvokeModel in
place of `forward` (`BedrockUpstream.messages`): Bedrock's event stream is re-framed as
Anthropic's SSE, event by event, and a throttle before the first content is a 429.

Not done on `anthropic` and `bedrock` routes: retries and fallbacks (a failure is the client's
to retry, as Anthropic's SDK does by itself).
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.boundary.admit import Admission, AdmittedRequest, ParsedBody
from gateway.boundary.body import parse_json, require_model
from gateway.boundary.client_watch import ClientWatch
from gateway.config.routes import Route
from gateway.config.settings import Settings
from gateway.doors.messages_relay import MessagesRelay, error_body, send_error
from gateway.doors.passthrough_relay import relay_answer
from gateway.doors.translated import MessagesShape, TranslatedFormat, translate_request
from gateway.errors import GatewayError
from gateway.paths import PassPath, fixed_path
from gateway.pipeline.chat import ChatPipeline
from gateway.pipeline.prepare import NativeBody, Preparation
from gateway.telemetry.record import RequestRecord
from gateway.translation.messages_chat import anthropic_error_type, messages_request_to_chat
from gateway.upstreams.anthropic import ANTHROPIC_VERSION
from gateway.upstreams.base import UpstreamError
from gateway.upstreams.bedrock import BedrockUpstream
from gateway.upstreams.bedrock_stream import MessagesSSE
from gateway.upstreams.bedrock_wire import is_anthropic_model as is_bedrock_claude
from gateway.upstreams.registry import Upstreams
from gateway.upstreams.vertex import is_anthropic_model
from policies.tokens import count_request_tokens

log = logging.getLogger("firsttoken.messages")

MESSAGES = fixed_path("messages")
COUNT_TOKENS = fixed_path("messages", "count_tokens")


class MessagesDoor:
    """`POST /v1/messages` (or its `count_tokens`): admitted once, then the exchange with an
    `anthropic` route, or the chat pipeline's answer converted back, or an Anthropic error."""

    def __init__(
        self,
        admission: Admission,
        pipeline: ChatPipeline,
        preparation: Preparation,
        upstreams: Upstreams,
        settings: Settings,
    ) -> None:
        self.admission = admission
        self.pipeline = pipeline
        self.preparation = preparation
        self.upstreams = upstreams
        self.settings = settings

    async def __call__(self, request: Request, path: PassPath) -> ASGIApp:
        count = path is COUNT_TOKENS
        admitted = self.admission.begin(request, "count_tokens" if count else "messages")
        try:
            await self.admission.admit(admitted, parse_count_tokens if count else parse_messages)
            await self._check_references(admitted)
            route = admitted.route
            if not speaks_messages(route, admitted.model, count):
                return await self._translated(admitted, path)
            record = self.pipeline.record_for(admitted)
            record.api = "messages"
            record.route = route.name
            if admitted.offloaded is not None:  # a big body, parsed and prepared in a worker
                prepared = self.preparation.native_offloaded(admitted, record)
            else:  # count_tokens is not a generation: no policy reports, no diagnostics
                prepared = await self.preparation.native(admitted, record, policies=not count)
        except GatewayError as exc:
            return anthropic_error(exc, admitted.request_id)
        return MessagesExchange(admitted, self.upstreams, self.settings, path, record, prepared)

    async def _check_references(self, admitted: AdmittedRequest) -> None:
        """The objects a native body names (a `file` source's `file_id` in a document or image
        block, a top-level `container`) must be the tenant's own, as on every other door: an id
        not created through the gateway by this tenant is a 404 that never reaches the route,
        checked on the client's body whatever the route kind (before any translation)."""
        objects = self.pipeline.objects
        if admitted.offloaded is not None:  # the worker found them
            await objects.routes_of(admitted.tenant, admitted.offloaded.references)
            return
        offload = self.preparation.offload
        heavy = offload.is_heavy(len(admitted.raw))
        await objects.check_references(
            admitted.tenant, admitted.raw, admitted.body, offload if heavy else None
        )

    async def _translated(self, admitted: AdmittedRequest, path: PassPath) -> ASGIApp:
        """A Messages request for an `openai` or `local` route, served by the chat pipeline."""
        assert admitted.body is not None
        translated = translate_request(
            messages_request_to_chat, admitted.body, admitted.model, admitted.route
        )
        if path is COUNT_TOKENS:
            count = count_request_tokens(translated.body)
            return Response(
                orjson.dumps({"input_tokens": count}),
                media_type="application/json",
                headers={"x-firsttoken-estimate": "cl100k_base count of the translated request"},
            )
        answer = TranslatedFormat(MessagesShape(admitted.model), translated.notes)
        return await self.pipeline.serve(admitted, translated.body, answer)


def speaks_messages(route: Route, model: str, count: bool = False) -> bool:
    """Whether the route takes Messages bodies natively: an `anthropic` route, or a Claude model
    on a `vertex` or `bedrock` route (its upstream adjusts the body: model in the URL, the
    platform's version). `count_tokens` on Bedrock is the translated estimate."""
    if route.kind == "anthropic":
        return True
    if route.kind == "vertex":
        return is_anthropic_model(route.upstream_model(model))
    if route.kind == "bedrock":
        return not count and is_bedrock_claude(route.upstream_model(model))
    return False


def anthropic_error(exc: GatewayError, request_id: str) -> Response:
    """A gateway error on this door, in Anthropic's shape."""
    return Response(
        error_body(exc.message, anthropic_error_type(exc.status)),
        status_code=exc.status,
        media_type="application/json",
        headers={"x-request-id": request_id, "request-id": request_id},
    )


def parse_messages(raw: bytes, settings: Settings) -> ParsedBody:
    """A Messages body within the same limits as chat; a 400 naming what is wrong."""
    body = parse_json(raw, settings.max_json_depth, settings.max_json_containers)
    model = require_model(body, settings.max_model_chars)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise GatewayError(400, "'messages' is required and must be an array.")
    if len(messages) > settings.max_messages:
        raise GatewayError(
            400,
            f"'messages' has more than {settings.max_messages} entries (FIRSTTOKEN_MAX_MESSAGES).",
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean.")
    return ParsedBody(body, model, stream is True)


def parse_count_tokens(raw: bytes, settings: Settings) -> ParsedBody:
    """A count_tokens body: a Messages body that never streams."""
    parsed = parse_messages(raw, settings)
    return ParsedBody(parsed.body, parsed.model, False)


def forward_headers(request: Request) -> dict[str, str]:
    """What the upstream gets of the client's headers: the API version and beta flags only."""
    headers = {
        "content-type": "application/json",
        "anthropic-version": request.headers.get("anthropic-version") or ANTHROPIC_VERSION,
    }
    beta = request.headers.get("anthropic-beta")
    if beta:
        headers["anthropic-beta"] = beta
    return headers


class MessagesExchange:
    """One Messages API request to an `anthropic` route, as a raw ASGI response so that the
    status line, the upstream connection and the client's departure are all in its hands."""

    def __init__(
        self,
        admitted: AdmittedRequest,
        upstreams: Upstreams,
        settings: Settings,
        path: PassPath,
        record: RequestRecord,
        prepared: NativeBody,
    ) -> None:
        self.request = admitted.request
        self.upstreams = upstreams
        self.settings = settings
        self.path = path
        self.request_id = admitted.request_id
        self.route = admitted.route
        self.stream = admitted.stream
        self.record = record
        self.prepared = prepared
        self.relay: MessagesRelay | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ClientWatch()
        watch.start(scope, receive)
        self.relay = MessagesRelay(
            send, self.record, self.request_id, self.route.name, self.settings, self.prepared
        )
        try:
            await self._exchange(self.route, self.prepared.data, self.stream)
        except asyncio.CancelledError:
            if not watch.absorbed():
                raise
            self.record.ended_with(499)
        except GatewayError as exc:
            await self._fail(send, exc)
        except Exception:  # a bug fails this request alone, with a clean 500 (logged)
            log.exception("request %s: unhandled error on %s", self.request_id, scope["path"])
            await self._fail(send, GatewayError(500, "Internal gateway error."))
        finally:
            watch.stop()
            self._record()

    # -- the exchange --------------------------------------------------------------------

    async def _exchange(self, route: Route, data: bytes, stream: bool) -> None:
        assert self.relay is not None
        upstream = self.upstreams[route.name]
        headers = forward_headers(self.request)
        timeout = route.timeout_s or self.settings.timeout_s
        try:
            async with asyncio.timeout(timeout):
                self.record.upstream_sent = time.perf_counter()
                if isinstance(upstream, BedrockUpstream):
                    await self._bedrock(upstream, headers, data, stream)
                    return
                try:
                    resp = await upstream.forward("POST", self.path, headers, data)
                except UpstreamError as exc:
                    raise GatewayError(exc.status, exc.message) from None
                relay = self.relay
                await relay_answer(resp, lambda r: relay.answer(r, stream))
        except TimeoutError:
            raise GatewayError(
                504, f"Upstream {route.name!r} did not answer within {timeout}s."
            ) from None

    async def _bedrock(
        self, upstream: BedrockUpstream, headers: dict[str, str], data: bytes, stream: bool
    ) -> None:
        """InvokeModel with the Messages body; its event stream goes out as Anthropic SSE."""
        assert self.relay is not None
        relay = self.relay
        try:
            answer = await upstream.messages(data, headers, stream)
        except UpstreamError as exc:
            raise GatewayError(exc.status, exc.message) from None
        if isinstance(answer, MessagesSSE):
            try:
                await relay.events(answer.raw_headers, answer.chunks())
            finally:
                answer.close()
        else:
            await relay_answer(answer, lambda r: relay.answer(r, False))

    async def _fail(self, send: Send, exc: GatewayError) -> None:
        level = logging.INFO if 400 <= exc.status < 500 else logging.WARNING
        log.log(level, "request %s failed: %s", self.request_id, exc.message)
        self.record.ended_with(exc.status)
        if self.relay is not None:
            await self.relay.error(exc)
        else:
            await send_error(send, exc, self.request_id)

    def _record(self) -> None:
        """One record per `messages` request that reached a route (count_tokens is not a
        generation and is not recorded)."""
        if self.path is MESSAGES:
            self.record.finish()
