"""Anthropic Messages <-> OpenAI chat translation, judged by the Anthropic SDK's own types."""

from __future__ import annotations

import copy

import anthropic
import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.translation.chat_to_anthropic import TranslationError, to_anthropic_request
from gateway.translation.messages_chat import (
    ChatToMessagesStream,
    Translated,
    anthropic_error_type,
    chat_completion_to_message,
    chat_error_to_messages,
    messages_request_to_chat,
)
from tests.translation.translation_helpers import (
    JUNK_CHUNKS,
    chat_tool_call,
    chunk,
    completion,
    feed_all,
    parse_sse,
    realistic_chunks,
    sse_http_client,
    tool_delta,
)

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def request(messages: list[dict], **fields) -> dict:
    return {"model": "gpt-x", "max_tokens": 100, "messages": messages, **fields}


def chat(messages: list[dict], **fields) -> dict:
    return messages_request_to_chat(request(messages, **fields)).body


# --- requests ---------------------------------------------------------------------------------


def test_minimal_request_keeps_model_and_max_tokens():
    out = messages_request_to_chat(request([{"role": "user", "content": "hi"}]))
    assert out == Translated(
        {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100},
        (),
    )


def test_system_string_and_text_blocks_become_one_leading_system_message():
    blocks = [
        {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Big manual."},
    ]
    out = chat([{"role": "user", "content": "q"}], system=blocks)
    assert out["messages"][0] == {"role": "system", "content": "Be terse.\n\nBig manual."}
    out = chat([{"role": "user", "content": "q"}], system="Be terse.")
    assert out["messages"][0] == {"role": "system", "content": "Be terse."}


def test_system_with_a_non_text_block_is_rejected():
    with pytest.raises(TranslationError) as err:
        chat([{"role": "user", "content": "q"}], system=[{"type": "image", "source": {}}])
    assert err.value.param == "system.0"


def test_user_blocks_become_parts_and_images_become_image_urls():
    out = chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
                ],
            }
        ]
    )
    assert out["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
            ],
        }
    ]


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages_in_order():
    out = chat(
        [
            {"role": "user", "content": "weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "w", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and be quick"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "timeout"},
                            {"type": "text", "text": "retry later"},
                        ],
                    },
                ],
            },
        ]
    )
    assert out["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                chat_tool_call("t1", "w", '{"city":"Paris"}'),
                chat_tool_call("t2", "w", '{"city":"Rome"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: timeout\n\nretry later"},
        {"role": "user", "content": [{"type": "text", "text": "and be quick"}]},
    ]


def test_thinking_blocks_and_thinking_setting_are_dropped_with_notes():
    out = messages_request_to_chat(
        request(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": "again"},
            ],
            thinking={"type": "enabled", "budget_tokens": 2000},
        )
    )
    assert out.notes == ("thinking blocks dropped", "thinking dropped")
    assert "thinking" not in out.body
    assert out.body["messages"][1] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    "block",
    [
        {"type": "document", "source": {"type": "text", "data": "x"}},
        {"type": "search_result", "source": "s", "title": "t", "content": []},
        {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}},
        {"type": "container_upload", "file_id": "f"},
    ],
)
def test_blocks_chat_cannot_carry_are_rejected_naming_the_type(block):
    with pytest.raises(TranslationError) as err:
        chat([{"role": "user", "content": [block]}])
    assert repr(block["type"]) in err.value.message
    assert err.value.param == "messages.0.content.0.type"


def test_image_inside_a_tool_result_is_rejected():
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "image", "source": {"type": "url", "url": "https://x.test/a"}}],
    }
    with pytest.raises(TranslationError, match="'image'"):
        chat([{"role": "user", "content": [result]}])


def test_tools_tool_choice_and_sampling_fields():
    tools = [
        {
            "name": "w",
            "description": "weather",
            "input_schema": WEATHER_SCHEMA,
            "cache_control": {"type": "ephemeral"},
        },
        {"type": "custom", "name": "n"},
    ]
    out = chat(
        [{"role": "user", "content": "q"}],
        tools=tools,
        tool_choice={"type": "tool", "name": "w", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        metadata={"user_id": "u"},
        service_tier="auto",
        stream=True,
    )
    assert out == {
        "model": "gpt-x",
        "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 100,
        "stop": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "tools": [
            {
                "type": "function",
                "function": {"name": "w", "description": "weather", "parameters": WEATHER_SCHEMA},
            },
            {
                "type": "function",
                "function": {"name": "n", "parameters": {"type": "object", "properties": {}}},
            },
        ],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")]
)
def test_tool_choice_types(choice, expected):
    tools = [{"name": "w", "input_schema": WEATHER_SCHEMA}]
    out = chat([{"role": "user", "content": "q"}], tools=tools, tool_choice={"type": choice})
    assert out["tool_choice"] == expected
    assert "parallel_tool_calls" not in out


@pytest.mark.parametrize("kind", ["web_search_20250305", "bash_20250124", "text_editor_20250728"])
def test_server_tools_are_rejected(kind):
    with pytest.raises(TranslationError) as err:
        chat([{"role": "user", "content": "q"}], tools=[{"type": kind, "name": "x"}])
    assert kind in err.value.message
    assert err.value.param == "tools.0.type"


def test_structured_output_format_becomes_response_format():
    fmt = {"type": "json_schema", "schema": WEATHER_SCHEMA}
    out = chat([{"role": "user", "content": "q"}], output_config={"format": fmt})
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": WEATHER_SCHEMA, "strict": True},
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"tool_choice": {"type": "sometimes"}, "tools": [{"name": "w"}]}, "tool_choice.type"),
    ],
)
def test_malformed_requests_are_rejected_with_the_param(fields, param):
    body = {**request([{"role": "user", "content": "q"}]), **fields}
    with pytest.raises(TranslationError) as err:
        messages_request_to_chat(body)
    assert err.value.param == param


def test_request_translation_is_pure_and_deterministic():
    body = request(
        [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
        system=[{"type": "text", "text": "s"}],
        tools=[{"name": "w", "input_schema": WEATHER_SCHEMA}],
    )
    before = copy.deepcopy(body)
    first = orjson.dumps(messages_request_to_chat(body).body)
    assert body == before
    assert orjson.dumps(messages_request_to_chat(copy.deepcopy(body)).body) == first


def test_translated_chat_body_is_accepted_by_the_anthropic_translation():
    body = request(
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "P"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        system="Be terse.",
        tools=[{"name": "w", "description": "weather", "input_schema": WEATHER_SCHEMA}],
        tool_choice={"type": "any"},
    )
    back = to_anthropic_request(messages_request_to_chat(body).body, "claude-x")
    assert back["system"] == [{"type": "text", "text": "Be terse."}]
    assert back["tool_choice"] == {"type": "any"}
    assert back["messages"][1]["content"] == [
        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "P"}}
    ]
    assert back["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
        {"type": "text", "text": "thanks"},
    ]


# --- whole responses --------------------------------------------------------------------------


def test_text_and_tool_calls_become_a_valid_message():
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            chat_tool_call("call_1", "w", '{"a":1}'),
            chat_tool_call("call_2", "w", "[1]"),
        ],
    }
    out = chat_completion_to_message(completion(message, "tool_calls"), "client-model")
    Message.model_validate(out)
    assert out == {
        "id": "msg_abc123",
        "type": "message",
        "role": "assistant",
        "model": "client-model",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_1", "name": "w", "input": {"a": 1}},
            {"type": "tool_use", "id": "call_2", "name": "w", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 20,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 100,
            "output_tokens": 30,
        },
    }


@pytest.mark.parametrize(
    ("finish", "stop"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
        ("weird", "end_turn"),
        (None, "end_turn"),
    ],
)
def test_finish_reasons_map_to_stop_reasons(finish, stop):
    out = chat_completion_to_message(completion({"content": "x"}, finish), "m")
    assert out["stop_reason"] == stop
    Message.model_validate(out)


@pytest.mark.parametrize(
    "junk",
    [
        {},
        {"choices": "nope", "usage": "nope", "id": 7},
        {"choices": [None, 3], "usage": {"prompt_tokens": -5, "completion_tokens": "9"}},
        {"choices": [{"message": {"content": 5, "tool_calls": [None, {"function": 3}]}}]},
        {"choices": [{"message": {"tool_calls": {"x": 1}}, "finish_reason": 12}]},
        {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 10**30}}},
    ],
)
def test_malformed_completions_still_give_a_valid_message(junk):
    out = chat_completion_to_message(junk, "m")
    message = Message.model_validate(out)
    assert message.usage.input_tokens >= 0
    assert message.id.startswith("msg_")


# --- streams ----------------------------------------------------------------------------------


REALISTIC = realistic_chunks(
    {
        "prompt_tokens": 50,
        "completion_tokens": 12,
        "total_tokens": 62,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
)


def run_stream(chunks: list[dict], model: str = "client-model") -> list[tuple[str, dict]]:
    return parse_sse(feed_all(ChatToMessagesStream(model), chunks))


def accumulate(events: list[tuple[str, dict]]) -> Message:
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for _, data in events:
        event = EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def test_stream_event_order_and_sdk_accumulation():
    events = run_stream(REALISTIC)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = accumulate(events)
    assert message.id == "msg_s1"
    assert message.model == "client-model"
    assert message.stop_reason == "tool_use"
    assert [block.model_dump(exclude_none=True) for block in message.content] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
    ]
    assert message.usage.input_tokens == 42
    assert message.usage.cache_read_input_tokens == 8
    assert message.usage.output_tokens == 12


def sse_client(body: bytes) -> anthropic.Anthropic:
    """An SDK client whose every request is answered with `body` as an SSE stream, offline."""

    return anthropic.Anthropic(
        api_key="k",
        base_url="http://gateway.invalid",
        http_client=sse_http_client(body),
        max_retries=0,
    )


def test_the_sdk_client_reads_the_stream_bytes_as_the_expected_message():
    body = b"".join(feed_all(ChatToMessagesStream("client-model"), REALISTIC))
    client = sse_client(body)
    with client.messages.stream(
        model="client-model", max_tokens=10, messages=[{"role": "user", "content": "q"}]
    ) as events:
        message = events.get_final_message()
    assert message.content[0].type == "text" and message.content[0].text == "Let me check."
    assert message.content[1].type == "tool_use" and message.content[1].input == {"city": "Paris"}
    assert (message.stop_reason, message.usage.input_tokens) == ("tool_use", 42)


def test_first_text_goes_out_with_its_chunk_and_the_end_waits_for_usage():
    stream = ChatToMessagesStream("m")
    first = parse_sse(stream.feed(chunk({"role": "assistant", "content": "Hi"})))
    assert [name for name, _ in first] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    assert first[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert [name for name, _ in parse_sse(stream.feed(chunk({}, "stop")))] == ["content_block_stop"]
    end = parse_sse(stream.feed(chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 1})))
    assert [name for name, _ in end] == ["message_delta", "message_stop"]
    assert end[0][1]["usage"]["output_tokens"] == 1
    assert stream.finish() == []
    assert stream.feed(chunk({"content": "late"})) == []


def test_stream_without_usage_chunk_ends_on_finish():
    events = run_stream([chunk({"content": "x"}), chunk({}, "length")])
    assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
    message = accumulate(events)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 0


def test_parallel_tool_calls_each_get_their_own_block():
    events = run_stream(
        [
            chunk(tool_delta(0, '{"a":', "c1", "f")),
            chunk(tool_delta(0, "1}")),
            chunk(tool_delta(1, '{"b":2}', "c2", "g")),
            chunk({}, "tool_calls"),
        ]
    )
    message = accumulate(events)
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("tool_use", {"a": 1}),
        ("tool_use", {"b": 2}),
    ]


def test_junk_chunks_are_ignored_and_the_stream_stays_valid():
    events = run_stream(
        [*JUNK_CHUNKS, chunk({"content": "ok"}, "stop", usage={"prompt_tokens": "many"})]
    )
    for _, data in events:
        EVENT.validate_python(data)
    message = accumulate(events)
    assert message.content[-1].type == "text"
    assert message.stop_reason == "end_turn"


def test_stream_output_is_deterministic_given_the_same_chunks():
    assert run_stream(REALISTIC) == run_stream(REALISTIC)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (418, "invalid_request_error"),
        (503, "overloaded_error"),
        (599, "api_error"),
    ],
)
def test_openai_errors_become_anthropic_errors(status, kind):
    body = {"error": {"message": "nope", "type": "whatever", "code": None}}
    assert chat_error_to_messages(status, body) == {
        "type": "error",
        "error": {"type": kind, "message": "nope"},
    }
    assert anthropic_error_type(status) == kind


@pytest.mark.parametrize("junk", [{}, {"error": None}, {"error": {"message": 3}}, "x", None])
def test_malformed_error_bodies_get_a_fallback_message(junk):
    out = chat_error_to_messages(502, junk)
    assert out == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream returned HTTP 502"},
    }
