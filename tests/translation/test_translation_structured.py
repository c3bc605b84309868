"""Structured output for Anthropic models as a forced answer tool: the request each
`response_format` becomes (alone and beside the client's own tools), the 400s that name the
client's field, and the answer coming back as content, whole and event by event."""

from __future__ import annotations

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.translation.anthropic import (
    AnthropicStreamTranslator,
    TranslationError,
    answer_tool,
    to_anthropic_request,
    to_openai_response,
)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": SCHEMA}}
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def translate(**fields) -> dict:
    return to_anthropic_request({"model": "c", "messages": USER, **fields}, "claude-x")


def test_json_schema_becomes_a_forced_tool_with_the_schema():
    out = translate(response_format=JSON_SCHEMA)
    assert out["tools"] == [
        {
            "name": "Weather",
            "description": "Give your answer as JSON that follows this tool's input schema.",
            "input_schema": SCHEMA,
        }
    ]
    assert out["tool_choice"] == {"type": "tool", "name": "Weather"}
    assert "response_format" not in out


def test_json_object_and_its_optional_schema():
    out = translate(response_format={"type": "json_object"})
    assert out["tool_choice"] == {"type": "tool", "name": "json_object"}
    assert out["tools"][0]["input_schema"] == {"type": "object", "additionalProperties": True}
    # instructor's JSON_SCHEMA mode sends the schema beside the type
    untyped = {"properties": {"a": {"type": "integer"}}}
    out = translate(response_format={"type": "json_object", "schema": untyped})
    assert out["tools"][0]["input_schema"] == {"type": "object", **untyped}
    assert "tools" not in translate(response_format={"type": "text"})


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, {"type": "any"}),
        ("auto", {"type": "any"}),
        ("required", {"type": "any"}),
        ("none", {"type": "tool", "name": "Weather"}),
    ],
)
def test_beside_the_clients_tools_the_model_calls_one_or_answers(choice, expected):
    fields = {"tools": [TOOL], "response_format": JSON_SCHEMA}
    if choice is not None:
        fields["tool_choice"] = choice
    out = translate(**fields)
    assert [t["name"] for t in out["tools"]] == ["lookup", "Weather"]  # the client's first
    assert out["tool_choice"] == expected
    if choice != "none":  # (a forced answer tool is one call anyway)
        out = translate(**fields, parallel_tool_calls=False)
        assert out["tool_choice"]["disable_parallel_tool_use"] is True


def test_a_clients_forced_function_is_this_turns_answer():
    forced = {"type": "function", "function": {"name": "Weather"}}
    weather = {"type": "function", "function": {"name": "Weather", "parameters": SCHEMA}}
    # instructor's RESPONSES_TOOLS: a forced function named like the text format
    out = translate(tools=[weather], tool_choice=forced, response_format=JSON_SCHEMA)
    assert [t["name"] for t in out["tools"]] == ["Weather"]
    assert out["tool_choice"] == {"type": "tool", "name": "Weather"}
    body = {"messages": USER, "tools": [weather], "tool_choice": forced}
    assert answer_tool({**body, "response_format": JSON_SCHEMA}) is None  # a tool call comes back


def test_an_answer_named_like_a_clients_tool_gets_a_name_of_its_own():
    weather = {"type": "function", "function": {"name": "Weather"}}
    out = translate(tools=[weather], response_format=JSON_SCHEMA)
    assert [t["name"] for t in out["tools"]] == ["Weather", "Weather_answer"]
    assert out["tool_choice"] == {"type": "any"}
    taken = [weather, {"type": "function", "function": {"name": "Weather_answer"}}]
    with pytest.raises(TranslationError) as info:
        translate(tools=taken, response_format=JSON_SCHEMA)
    assert info.value.param == "response_format"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "array"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object", "schema": []}}, "response_format.schema"),
        (
            {
                "response_format": JSON_SCHEMA,
                "thinking": {"type": "enabled", "budget_tokens": 2000},
            },
            "response_format",
        ),
    ],
)
def test_what_cannot_be_expressed_names_the_clients_field(fields, param):
    with pytest.raises(TranslationError) as info:
        translate(**fields)
    assert info.value.param == param


def message(content: list[dict], stop_reason: str = "tool_use") -> dict:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": content,
        "stop_reason": stop_reason,
        "usage": {"input_tokens": 3, "output_tokens": 5},
    }


def call(name: str, arguments: dict, block_id: str = "toolu_1") -> dict:
    return {"type": "tool_use", "id": block_id, "name": name, "input": arguments}


def test_a_whole_answer_is_content_ending_with_stop():
    resp = message([call("Weather", {"city": "Paris"}), call("Weather", {"city": "Rome"}, "t2")])
    out = to_openai_response(resp, "m", answer_tool="Weather")
    ChatCompletion.model_validate(out)
    choice = out["choices"][0]
    assert orjson.loads(choice["message"]["content"]) == {"city": "Paris"}  # the first only
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    cut = to_openai_response(
        message([call("Weather", {})], "max_tokens"), "m", answer_tool="Weather"
    )
    assert cut["choices"][0]["finish_reason"] == "length"
    # the client's own tool calls stay tool calls, and then the answer is not over
    mixed = message([call("lookup", {"q": 1}, "t0"), call("Weather", {"city": "Paris"})])
    choice = to_openai_response(mixed, "m", answer_tool="Weather")["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["lookup"]
    assert choice["finish_reason"] == "tool_calls"
    # without an answer tool, a tool_use is a tool call as ever
    plain = to_openai_response(message([call("Weather", {})]), "m")["choices"][0]
    assert plain["finish_reason"] == "tool_calls" and plain["message"]["content"] is None


def events(pieces: list[str], index: int = 0) -> list[tuple[str, dict]]:
    start = {"id": "msg_s", "type": "message", "role": "assistant", "content": [], "usage": {}}
    block = {"type": "tool_use", "id": "toolu_1", "name": "Weather", "input": {}}
    out = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        ),
    ]
    for piece in pieces:
        delta = {"type": "input_json_delta", "partial_json": piece}
        out.append(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        )
    out += [
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use"},
                "usage": {"output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return out


def streamed(pieces: list[str]) -> tuple[list[str], list[str | None]]:
    translator = AnthropicStreamTranslator("m", include_usage=False, answer_tool="Weather")
    chunks = [chunk for name, data in events(pieces) for chunk in translator.feed(name, data)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)
    return [text for text in contents if text], reasons


def test_a_streamed_answer_is_content_deltas_as_they_come():
    contents, reasons = streamed(['{"ci', 'ty": "Pa', 'ris"}'])
    assert contents == ['{"ci', 'ty": "Pa', 'ris"}']
    assert reasons[-1] == "stop"


def test_a_streamed_answer_with_no_input_is_the_empty_object():
    contents, reasons = streamed([])
    assert contents == ["{}"] and reasons[-1] == "stop"
