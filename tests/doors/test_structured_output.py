"""Structured output on an `anthropic` route, through the gateway, with the clients' own parsers:
the OpenAI SDK's `chat.completions.parse`, its chat stream, `responses.parse` and
`responses.stream(text_format=...)`, against a mock Anthropic server that answers a forced tool
the way the Messages API does (a `tool_use` block; streamed as `input_json_delta` fragments)."""

from __future__ import annotations

import openai
import orjson
import pytest
from aiohttp import web
from pydantic import BaseModel

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route

ANSWER = {"city": "Paris", "temperature_c": 21, "conditions": ["sunny", "calm"]}


class Weather(BaseModel):
    city: str
    temperature_c: int
    conditions: list[str]


class ForcedToolAnthropic(MockUpstream):
    """Answers a forced tool (`tool_choice: {"type": "tool"}`) with ANSWER as its input, and
    anything else with text, in the Messages API's own shapes."""

    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        choice = body.get("tool_choice") or {}
        if choice.get("type") != "tool":
            return await super().anthropic_messages(request)
        tool = {"type": "tool_use", "id": "toolu_01", "name": choice["name"]}
        usage = {"input_tokens": 30, "output_tokens": 12}
        message = {
            "id": "msg_structured",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "stop_sequence": None,
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    **message,
                    "content": [{**tool, "input": ANSWER}],
                    "stop_reason": "tool_use",
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n")

        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {**usage, "output_tokens": 1},
        }
        await event("message_start", {"type": "message_start", "message": start})
        await event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {**tool, "input": {}}},
        )
        await event("ping", {"type": "ping"})
        text = orjson.dumps(ANSWER).decode()
        for piece in (text[:7], text[7:30], text[30:]):
            delta = {"type": "input_json_delta", "partial_json": piece}
            await event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        await event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 12},
            },
        )
        await event("message_stop", {"type": "message_stop"})
        return resp


@pytest.fixture
def claude():
    with ThreadedServer(ForcedToolAnthropic(MockBehaviour())) as server:
        yield server


def sent(server: ThreadedServer) -> dict:
    (request,) = [r for r in server.mock.requests if r["path"] == "/v1/messages"]
    return request["body"]


def test_chat_parse_gets_the_forced_tools_input_as_content(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    completion = sdk_client(gw).chat.completions.parse(
        model="claude-sonnet-4-5",
        messages=[{"role": "user", "content": "Weather in Paris as JSON"}],
        response_format=Weather,
    )
    choice = completion.choices[0]
    assert choice.message.parsed == Weather(**ANSWER)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    body = sent(claude)
    assert body["tool_choice"] == {"type": "tool", "name": "Weather"}
    (tool,) = body["tools"]
    assert tool["name"] == "Weather"
    assert tool["input_schema"]["properties"]["city"] == {"title": "City", "type": "string"}
    assert "response_format" not in body


def test_chat_stream_relays_input_json_deltas_as_content(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    with sdk_client(gw).chat.completions.stream(
        model="claude-sonnet-4-5",
        messages=[{"role": "user", "content": "Weather in Paris as JSON"}],
        response_format=Weather,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta" and e.delta]
        final = stream.get_final_completion()
    assert len(deltas) == 3 and orjson.loads("".join(deltas)) == ANSWER
    assert final.choices[0].message.parsed == Weather(**ANSWER)
    assert final.choices[0].finish_reason == "stop"


def test_responses_parse_and_stream_with_text_format(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    client = sdk_client(gw)
    parsed = client.responses.parse(
        model="claude-sonnet-4-5", input="Weather in Paris as JSON", text_format=Weather
    )
    assert parsed.output_parsed == Weather(**ANSWER)
    assert parsed.status == "completed"
    with client.responses.stream(
        model="claude-sonnet-4-5", input="Weather in Paris as JSON", text_format=Weather
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert orjson.loads("".join(deltas)) == ANSWER
    assert final.output_parsed == Weather(**ANSWER)
    bodies = [r["body"] for r in claude.mock.requests]
    assert [b["tool_choice"] for b in bodies] == [{"type": "tool", "name": "Weather"}] * 2


def test_json_object_is_a_forced_open_object_tool(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    completion = sdk_client(gw).chat.completions.create(
        model="claude-sonnet-4-5",
        messages=[{"role": "user", "content": "Weather in Paris, in JSON"}],
        response_format={"type": "json_object"},
    )
    assert orjson.loads(completion.choices[0].message.content) == ANSWER
    assert completion.choices[0].finish_reason == "stop"
    body = sent(claude)
    assert body["tool_choice"] == {"type": "tool", "name": "json_object"}
    assert body["tools"][0]["input_schema"] == {"type": "object", "additionalProperties": True}


def test_an_untranslatable_schema_is_a_400_naming_the_clients_field(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    response = sdk_client(gw).chat.completions.with_raw_response
    with pytest.raises(Exception) as info:
        response.create(
            model="claude-sonnet-4-5",
            messages=[{"role": "user", "content": "a list"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "items", "schema": {"type": "array"}},
            },
        )
    error = info.value
    assert getattr(error, "status_code", None) == 400
    assert error.body["param"] == "response_format.json_schema.schema"  # type: ignore[attr-defined]
    assert not claude.mock.requests


def test_on_the_responses_door_the_error_names_text_format(claude, make_gateway):
    gw = make_gateway([anthropic_route(claude)])
    with pytest.raises(openai.BadRequestError) as info:
        sdk_client(gw).responses.create(
            model="claude-sonnet-4-5",
            input="a list",
            text={"format": {"type": "json_schema", "name": "items", "schema": {"type": "array"}}},
        )
    error = info.value.body
    assert error["param"] == "text.format.schema"
    assert "'text.format.schema'" in error["message"] and "response_format" not in error["message"]
    assert not claude.mock.requests


# -- structured-output libraries, where installed (neither is a dependency of the gateway) -----


def test_instructor_json_schema_and_responses_tools_modes(claude, make_gateway):
    instructor = pytest.importorskip("instructor")
    gw = make_gateway([anthropic_route(claude)])
    messages = [{"role": "user", "content": "Weather in Paris"}]
    chat = instructor.from_openai(sdk_client(gw), mode=instructor.Mode.JSON_SCHEMA)
    weather = chat.chat.completions.create(
        model="claude-sonnet-4-5", response_model=Weather, messages=messages, max_retries=0
    )
    assert weather.model_dump() == ANSWER
    responses = instructor.from_openai(sdk_client(gw), mode=instructor.Mode.RESPONSES_TOOLS)
    weather = responses.responses.create(
        model="claude-sonnet-4-5", response_model=Weather, input="Weather in Paris", max_retries=0
    )
    assert weather.model_dump() == ANSWER
    first, second = (r["body"] for r in claude.mock.requests)
    assert first["tool_choice"]["type"] == "tool" and "response_format" not in first
    assert second["tool_choice"] == {"type": "tool", "name": "Weather"}


def test_dspy_predict(claude, make_gateway, monkeypatch):
    """dspy's ChatAdapter answer fails to parse (the mock answers free text), and dspy falls
    back to its JSONAdapter: structured output, through the forced tool."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of litellm's model map
    dspy = pytest.importorskip("dspy")
    gw = make_gateway([anthropic_route(claude)])
    lm = dspy.LM(
        "openai/claude-sonnet-4-5", api_base=gw.url + "/v1", api_key="k", cache=False, num_retries=0
    )
    predict = dspy.Predict("question -> city: str, temperature_c: int, conditions: list[str]")
    with dspy.context(lm=lm):
        answer = predict(question="Weather in Paris?")
    assert (answer.city, answer.temperature_c, answer.conditions) == (
        ANSWER["city"],
        ANSWER["temperature_c"],
        ANSWER["conditions"],
    )
    structured = [r["body"] for r in claude.mock.requests if r["body"].get("tool_choice")]
    assert structured and structured[-1]["tool_choice"]["type"] == "tool"
