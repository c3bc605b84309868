"""OpenAI Responses <-> OpenAI chat translation, judged by the OpenAI SDK's own types."""

from __future__ import annotations

import copy

import openai
import orjson
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.translation.chat_to_anthropic import TranslationError, to_anthropic_request
from gateway.translation.messages_chat import Translated
from gateway.translation.responses_chat import (
    ChatToResponsesStream,
    chat_completion_to_response,
    responses_request_to_chat,
)
from tests.translation.translation_helpers import (
    JUNK_CHUNKS,
    USAGE,
    chat_tool_call,
    chunk,
    completion,
    feed_all,
    parse_sse,
    realistic_chunks,
    sse_http_client,
    tool_delta,
)

EVENT = TypeAdapter(ResponseStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER_TOOL = {
    "type": "function",
    "name": "weather",
    "description": "weather by city",
    "parameters": SCHEMA,
    "strict": True,
}


def chat(**fields) -> dict:
    return responses_request_to_chat({"model": "claude-x", **fields}).body


# --- requests ---------------------------------------------------------------------------------


def test_string_input_and_instructions():
    out = responses_request_to_chat(
        {"model": "claude-x", "instructions": "Be terse.", "input": "hi", "max_output_tokens": 64}
    )
    assert out == Translated(
        {
            "model": "claude-x",
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 64,
        },
        (),
    )


def test_message_items_with_parts_and_images():
    out = chat(
        input=[
            {"role": "developer", "content": "rules"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                ],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "A cat.", "annotations": []}],
            },
        ]
    )
    assert out["messages"] == [
        {"role": "developer", "content": "rules"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {
                    "type": "image_url",
                    "image_url": {"url": "https://x.test/a.png", "detail": "low"},
                },
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {"role": "assistant", "content": "A cat."},
    ]


def test_function_calls_merge_into_one_assistant_message_and_outputs_become_tool_messages():
    out = responses_request_to_chat(
        {
            "model": "claude-x",
            "input": [
                {"role": "user", "content": "Paris and Rome?"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": "Checking."},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
            ],
        }
    )
    assert out.notes == ("reasoning items dropped",)
    assert out.body["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                chat_tool_call("c1", "weather", "{}"),
                chat_tool_call("c2", "weather", '{"city":"Rome"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_function_call_without_preceding_text_opens_an_assistant_message():
    out = chat(
        input=[
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]
    )
    assert out["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [chat_tool_call("c1", "f", "{}")],
    }


def test_tools_tool_choice_format_and_settings():
    out = responses_request_to_chat(
        {
            "model": "claude-x",
            "input": "q",
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "weather"},
            "parallel_tool_calls": False,
            "temperature": 0.2,
            "top_p": 0.5,
            "user": "u1",
            "text": {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA}},
            "reasoning": {"effort": "high"},
            "store": True,
            "metadata": {"k": "v"},
            "include": ["reasoning.encrypted_content"],
            "truncation": "auto",
            "service_tier": "auto",
            "prompt_cache_key": "p",
            "safety_identifier": "s",
            "stream": True,
        }
    )
    assert out.notes == ("reasoning dropped",)
    assert out.body == {
        "model": "claude-x",
        "messages": [{"role": "user", "content": "q"}],
        "temperature": 0.2,
        "top_p": 0.5,
        "user": "u1",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "weather by city",
                    "parameters": SCHEMA,
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": SCHEMA},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_string_tool_choices_are_kept(choice):
    assert chat(input="q", tools=[WEATHER_TOOL], tool_choice=choice)["tool_choice"] == choice


def test_json_object_format():
    out = chat(input="q", text={"format": {"type": "json_object"}})
    assert out["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat(input="q", text={"format": {"type": "text"}})


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "web_search"},
        {"type": "web_search_preview"},
        {"type": "file_search", "vector_store_ids": ["vs"]},
        {"type": "code_interpreter", "container": {"type": "auto"}},
        {"type": "computer_use_preview", "display_width": 1, "display_height": 1},
        {"type": "image_generation"},
        {"type": "mcp", "server_label": "x"},
        {"type": "local_shell"},
        {"type": "custom", "name": "c"},
    ],
)
def test_built_in_tools_are_rejected(tool):
    with pytest.raises(TranslationError) as err:
        chat(input="q", tools=[tool])
    assert "only served by OpenAI routes" in err.value.message
    assert err.value.param == "tools"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
    ],
)
def test_server_side_state_is_rejected_naming_the_field(fields, param):
    with pytest.raises(TranslationError) as err:
        chat(input="q", **fields)
    assert err.value.param == param
    assert param in err.value.message


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "item_reference", "id": "msg_1"}, "input.0.type"),
        ({"type": "web_search_call", "id": "ws_1"}, "input.0.type"),
        (
            {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]},
            "input.0.content.0.image_url",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
            "input.0.content.0.type",
        ),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            "input.0.content.0.type",
        ),
        ({"role": "tool", "content": "x"}, "input.0.role"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input.0.arguments"),
    ],
)
def test_untranslatable_items_are_rejected(item, param):
    with pytest.raises(TranslationError) as err:
        chat(input=[item])
    assert err.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"instructions": ["x"]}, "instructions"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ],
)
def test_malformed_requests_are_rejected(fields, param):
    body = {"model": "claude-x", "input": "q", "tools": [WEATHER_TOOL], **fields}
    with pytest.raises(TranslationError) as err:
        responses_request_to_chat(body)
    assert err.value.param == param


def test_request_translation_is_pure_and_deterministic():
    body = {
        "model": "claude-x",
        "instructions": "i",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "r"},
        ],
        "tools": [WEATHER_TOOL],
    }
    before = copy.deepcopy(body)
    first = orjson.dumps(responses_request_to_chat(body).body)
    assert body == before
    assert orjson.dumps(responses_request_to_chat(copy.deepcopy(body)).body) == first


def test_translated_chat_body_is_accepted_by_the_anthropic_translation():
    body = {
        "model": "claude-x",
        "instructions": "Be terse.",
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_output_tokens": 300,
    }
    back = to_anthropic_request(responses_request_to_chat(body).body, "claude-x")
    assert back["system"] == [{"type": "text", "text": "Be terse."}]
    assert back["max_tokens"] == 300
    assert back["tool_choice"] == {"type": "any"}
    assert back["messages"][1:] == [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "c1", "name": "weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}],
        },
    ]


# --- whole responses --------------------------------------------------------------------------

REQUEST = {
    "model": "alias",
    "instructions": "Be terse.",
    "input": "q",
    "tools": [WEATHER_TOOL],
    "temperature": 0.3,
    "max_output_tokens": 500,
    "metadata": {"k": "v"},
}
TOOL_MESSAGE = {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [chat_tool_call("call_1", "weather", '{"city":"Paris"}')],
}


def test_text_and_tool_calls_become_a_valid_response():
    out = chat_completion_to_response(completion(TOOL_MESSAGE, "tool_calls"), REQUEST, "alias")
    response = Response.model_validate(out)
    assert out["id"] == "resp_abc123"
    assert out["created_at"] == 1700000000
    assert out["status"] == "completed"
    assert out["incomplete_details"] is None
    assert out["output"] == [
        {
            "id": "msg_abc123",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "id": "fc_abc123_0",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "weather",
            "arguments": '{"city":"Paris"}',
        },
    ]
    assert out["usage"] == {
        "input_tokens": 120,
        "input_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 0},
        "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 150,
    }
    assert response.output_text == "Checking."
    assert response.instructions == "Be terse."
    assert response.max_output_tokens == 500
    assert response.temperature == 0.3
    assert response.metadata == {"k": "v"}
    assert response.tool_choice == "auto"
    assert response.parallel_tool_calls is True
    assert response.store is False
    assert response.truncation == "disabled"
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text"
    assert [tool.model_dump(exclude_none=True) for tool in response.tools] == [WEATHER_TOOL]


def test_length_finish_gives_an_incomplete_response():
    out = chat_completion_to_response(completion({"content": "cut"}, "length"), {}, "m")
    response = Response.model_validate(out)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_echoes_json_schema_format_and_tool_choice():
    request = {
        "input": "q",
        "tool_choice": {"type": "function", "name": "weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}},
    }
    out = chat_completion_to_response(completion({"content": "{}"}), request, "m")
    response = Response.model_validate(out)
    assert out["tool_choice"] == {"type": "function", "name": "weather"}
    assert out["text"] == {
        "format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}
    }
    assert response.parallel_tool_calls is False


@pytest.mark.parametrize(
    "junk",
    [
        {},
        {"choices": "nope", "usage": "nope", "id": 7, "created": "now"},
        {"choices": [None, 3], "usage": {"prompt_tokens": -5, "completion_tokens": "9"}},
        {"choices": [{"message": {"content": 5, "tool_calls": [None, {"function": 3}]}}]},
        {"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": 5}}]}}]},
    ],
)
def test_malformed_completions_still_give_a_valid_response(junk):
    out = chat_completion_to_response(junk, {"tools": "x", "metadata": [1]}, "m")
    response = Response.model_validate(out)
    assert response.id.startswith("resp_")
    assert response.usage is not None and response.usage.input_tokens >= 0


# --- streams ----------------------------------------------------------------------------------


REALISTIC = realistic_chunks(USAGE)


def run_stream(chunks: list[dict], request: dict = REQUEST) -> list[tuple[str, dict]]:
    events = parse_sse(feed_all(ChatToResponsesStream(request, "alias"), chunks))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def accumulate(events: list[tuple[str, dict]]) -> Response:
    """Feed the events through the SDK's own stream state, as `client.responses.stream` does."""
    state: ResponseStreamState = ResponseStreamState(input_tools=omit, text_format=omit)
    for _, data in events:
        state.handle_event(EVENT.validate_python(data))
    final = state._completed_response
    assert final is not None
    return Response.model_validate(without_parsed(final.model_dump(by_alias=True)))


def without_parsed(value):
    """The SDK's parsed snapshot adds `parsed` / `parsed_arguments` (None without a format)."""
    if isinstance(value, dict):
        return {
            k: without_parsed(v)
            for k, v in value.items()
            if k not in ("parsed", "parsed_arguments") or v is not None
        }
    if isinstance(value, list):
        return [without_parsed(v) for v in value]
    return value


def test_stream_event_order_and_sdk_accumulation():
    events = run_stream(REALISTIC)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[0][1]["response"]["output"] == []
    # the SDK's 2.x and 3.0 types require the call's name on its done event
    done = dict(events)["response.function_call_arguments.done"]
    assert (done["name"], done["arguments"]) == ("weather", '{"city": "Paris"}')
    response = accumulate(events)
    # The same answer, whole: the stream must end with what the whole translation builds.
    message = {
        "content": "Let me check.",
        "tool_calls": [
            {"id": "call_1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    whole = {**completion(message, "tool_calls"), "id": "chatcmpl-s1", "created": 1700000001}
    assert events[-1][1]["response"] == chat_completion_to_response(whole, REQUEST, "alias")
    completed = Response.model_validate(events[-1][1]["response"])
    assert response.model_dump(by_alias=True) == completed.model_dump(by_alias=True)
    assert response.output_text == "Let me check."


def test_the_sdk_client_reads_the_stream_bytes_as_the_expected_response():
    body = b"".join(feed_all(ChatToResponsesStream(REQUEST, "alias"), REALISTIC))
    client = openai.OpenAI(
        api_key="k",
        base_url="http://gateway.invalid/v1",
        http_client=sse_http_client(body),
        max_retries=0,
    )
    with client.responses.stream(model="alias", input="q", tools=[WEATHER_TOOL]) as events:
        response = events.get_final_response()
    assert response.output_text == "Let me check."
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "weather", '{"city": "Paris"}')
    assert response.usage is not None and response.usage.total_tokens == 150


def test_first_text_goes_out_with_its_chunk_and_the_end_waits_for_usage():
    stream = ChatToResponsesStream({}, "m")
    first = parse_sse(stream.feed(chunk({"role": "assistant", "content": "Hi"})))
    assert [name for name, _ in first] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert first[-1][1]["delta"] == "Hi"
    closing = parse_sse(stream.feed(chunk({}, "stop")))
    assert [name for name, _ in closing] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    end = parse_sse(stream.feed(chunk(None, usage=USAGE)))
    assert [name for name, _ in end] == ["response.completed"]
    assert end[0][1]["response"]["usage"]["total_tokens"] == 150
    assert stream.finish() == []


def test_length_finish_ends_with_response_incomplete():
    events = run_stream([chunk({"content": "cut"}), chunk({}, "length")], {})
    assert events[-1][0] == "response.incomplete"
    for _, data in events:
        EVENT.validate_python(data)
    response = Response.model_validate(events[-1][1]["response"])
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut"


def test_parallel_tool_calls_and_text_after_a_call():
    events = run_stream(
        [
            chunk(tool_delta(0, '{"a":', "c1", "f")),
            chunk(tool_delta(0, "1}")),
            chunk(tool_delta(1, '{"b":2}', "c2", "g")),
            chunk({"content": "done"}),
            chunk({}, "tool_calls"),
        ]
    )
    response = accumulate(events)
    assert [(item.type, getattr(item, "arguments", None)) for item in response.output] == [
        ("function_call", '{"a":1}'),
        ("function_call", '{"b":2}'),
        ("message", None),
    ]
    assert len({item.id for item in response.output}) == 3


def test_junk_chunks_are_ignored_and_the_stream_stays_valid():
    events = run_stream(
        [*JUNK_CHUNKS, chunk({"content": "ok"}, "stop", usage={"prompt_tokens": "many"})],
        {},
    )
    response = accumulate(events)
    assert response.output_text == "ok"
    assert response.status == "completed"


def test_stream_output_is_deterministic_given_the_same_chunks():
    assert run_stream(REALISTIC) == run_stream(REALISTIC)
