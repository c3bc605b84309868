"""`POST /v1/responses`: OpenAI's Responses API as a first-class door.

The body is checked like chat's (a 400 in OpenAI's shape) and routed by its `model` like chat:

- to an `openai` route it goes in its own shape, through the route's policies (slim and
  canonicalize `instructions`, `input` items and `tools`; `prompt_cache_key`; prefix
  diagnostics), and the answer is relayed by the passthrough exchange (its limits, tenant
  ownership of the stored response), read on the way for TTFT (the first output delta) and usage
  (cached tokens included);
- to an `anthropic` or `local` route it is translated to chat (`gateway.translation`) and served
  by the chat path, its answer translated back as it streams. What only OpenAI keeps on its side
  (`previous_response_id`, built-in tools, stored prompts) is a 400 that says so.

`GET`/`DELETE /v1/responses/{id}` and its `input_items` stay with the passthrough, which sends
them to the route that created the response, for the tenant that created it.
"""

from __future__ import annotations

import time

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp

from gateway.boundary.admit import Admission, AdmittedRequest, ParsedBody
from gateway.boundary.body import parse_json, require_model
from gateway.config.settings import Settings
from gateway.doors.passthrough import Exchange, Passthrough, ReadyBody
from gateway.doors.translated import ResponsesShape, TranslatedFormat, translate_request
from gateway.errors import GatewayError
from gateway.pipeline.chat import ChatPipeline
from gateway.pipeline.prepare import NativeBody, Preparation
from gateway.sse import SSEEvent, event_name
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.usage import token_count
from gateway.translation.responses_chat import responses_request_to_chat

# The deltas that carry output: the first of them is the first token.
OUTPUT_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.audio.delta",
        "response.audio.transcript.delta",
    }
)
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesDoor:
    """`POST /v1/responses`: admitted once, then native or translated by its first route."""

    def __init__(
        self,
        admission: Admission,
        pipeline: ChatPipeline,
        preparation: Preparation,
        passthrough: Passthrough,
    ) -> None:
        self.admission = admission
        self.pipeline = pipeline
        self.preparation = preparation
        self.passthrough = passthrough

    async def __call__(self, request: Request) -> ASGIApp:
        admitted = self.admission.begin(request, "responses")
        try:
            await self.admission.admit(admitted, parse_responses)
            route, body = admitted.route, admitted.body
            if admitted.offloaded is not None:  # a big body for an openai route, from a worker
                return await self._offloaded(admitted)
            assert body is not None
            if route.kind != "openai":
                translated = translate_request(
                    responses_request_to_chat, body, admitted.model, route
                )
                shape = ResponsesShape(body, admitted.model)
                answer = TranslatedFormat(shape, translated.notes)
                return await self.pipeline.serve(admitted, translated.body, answer)
            record = self.pipeline.record_for(admitted)
            record.route = route.name
            prepared = await self.preparation.native(admitted, record)
        except GatewayError as exc:
            return exc.to_response(admitted.request_id)
        observer = ResponsesObserver(record, prepared)
        return Exchange(admitted, self.passthrough, ReadyBody(prepared.data, body, observer))

    async def _offloaded(self, admitted: AdmittedRequest) -> ASGIApp:
        """A big body that a worker parsed, checked and prepared for its `openai` route: its
        object references were found there and are checked here, before the exchange (which
        then has no parsed body to read)."""
        big = admitted.offloaded
        await self.pipeline.objects.routes_of(admitted.tenant, big.references)
        record = self.pipeline.record_for(admitted)
        record.route = admitted.route.name
        prepared = self.preparation.native_offloaded(admitted, record)
        observer = ResponsesObserver(record, prepared)
        return Exchange(admitted, self.passthrough, ReadyBody(prepared.data, {}, observer))


def parse_responses(raw: bytes, settings: Settings) -> ParsedBody:
    """A Responses body, checked enough to route and measure it."""
    body = parse_json(raw, settings.max_json_depth, settings.max_json_containers)
    model = require_model(body, settings.max_model_chars)
    stream = validate_responses(body, settings.max_messages)
    return ParsedBody(body, model, stream)


def validate_responses(body: dict, max_items: int) -> bool:
    """Enough of the body checked to route and measure it; the rest is the route's to judge.
    Returns `stream`."""
    items = body.get("input")
    if not isinstance(items, str | list):
        raise GatewayError(
            400, "'input' is required and must be a string or an array.", param="input"
        )
    if isinstance(items, list) and len(items) > max_items:
        raise GatewayError(
            400,
            f"'input' has more than {max_items} items (FIRSTTOKEN_MAX_MESSAGES).",
            param="input",
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "'instructions' must be a string.", param="instructions")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise GatewayError(400, "'tools' must be an array.", param="tools")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean.", param="stream")
    return stream is True


def chat_usage(usage: object) -> dict | None:
    """Responses usage (`input_tokens`, `input_tokens_details.cached_tokens`, ...) in chat's
    shape, the one telemetry reads; every number is checked (the upstream is untrusted)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return {
        "prompt_tokens": token_count(usage.get("input_tokens")),
        "completion_tokens": token_count(usage.get("output_tokens")),
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ResponsesObserver:
    """Reads a native Responses answer for telemetry as the passthrough relays it, adds the
    policy headers, and finishes the request's record when it ends."""

    def __init__(self, record: RequestRecord, prepared: NativeBody) -> None:
        self.record = record
        self.prepared = prepared

    async def headers(self) -> dict[str, str]:
        return {"x-request-id": self.record.request_id, **await self.prepared.headers()}

    def whole(self, raw: bytes) -> None:
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return
        if isinstance(payload, dict):
            self.record.usage = chat_usage(payload.get("usage"))

    def events(self, events: list[SSEEvent], arrived: float) -> None:
        content = False
        for event in events:
            name = event_name(event)
            if name in OUTPUT_DELTAS:
                content = True
            elif name in FINAL_EVENTS:
                if name == "response.failed":
                    self.record.status = "upstream_error"
                self._final_usage(event.data)
            elif name == "error":
                self.record.status = "upstream_error"
        if content:
            self.record.content_arrived(arrived, time.perf_counter())

    def _final_usage(self, data: bytes | None) -> None:
        try:
            payload = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            return
        response = payload.get("response") if isinstance(payload, dict) else None
        if isinstance(response, dict):
            self.record.usage = chat_usage(response.get("usage"))

    def finish(self, status: int) -> None:
        self.record.ended_with(status)
        self.record.finish()
