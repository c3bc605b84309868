"""OpenAI <-> Anthropic Messages translation, request by request and event by event."""

from __future__ import annotations

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.translation.anthropic import (
    DEFAULT_MAX_TOKENS,
    AnthropicStreamError,
    AnthropicStreamTranslator,
    TranslationError,
    error_to_openai,
    openai_usage,
    to_anthropic_request,
    to_openai_response,
)
from gateway.upstreams.base import chunk_has_content

MODEL = "claude-test-1"
EPHEMERAL = {"type": "ephemeral"}


def translate(messages: list[dict], **fields) -> dict:
    return to_anthropic_request({"model": "client-name", "messages": messages, **fields}, MODEL)


# --- requests ---------------------------------------------------------------------------------


def test_minimal_request_gets_model_default_max_tokens_and_text_blocks():
    out = translate([{"role": "user", "content": "hi"}])
    assert out == {
        "model": MODEL,
        "max_tokens": DEFAULT_MAX_TOKENS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }


def test_system_and_developer_messages_become_top_level_system_keeping_cache_control():
    out = translate(
        [
            {"role": "system", "content": "You are terse."},
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Big manual.", "cache_control": EPHEMERAL}],
            },
            {"role": "user", "content": "q"},
        ]
    )
    assert out["system"] == [
        {"type": "text", "text": "You are terse."},
        {"type": "text", "text": "Big manual.", "cache_control": EPHEMERAL},
    ]
    assert [turn["role"] for turn in out["messages"]] == ["user"]


def test_message_level_cache_control_lands_on_the_last_block():
    out = translate(
        [
            {"role": "system", "content": "sys", "cache_control": EPHEMERAL},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
        ]
    )
    assert out["system"] == [{"type": "text", "text": "sys", "cache_control": EPHEMERAL}]
    blocks = out["messages"][0]["content"]
    assert "cache_control" not in blocks[0]
    assert blocks[1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_consecutive_same_role_turns_are_merged_to_keep_alternation():
    out = translate(
        [
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "three"},
            {"role": "assistant", "content": [{"type": "text", "text": "four"}]},
            {"role": "user", "content": "five"},
        ]
    )
    assert out["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "three"}, {"type": "text", "text": "four"}],
        },
        {"role": "user", "content": [{"type": "text", "text": "five"}]},
    ]


def test_empty_assistant_text_is_dropped_and_neighbours_still_alternate():
    out = translate(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "b"},
        ]
    )
    assert len(out["messages"]) == 1
    assert [b["text"] for b in out["messages"][0]["content"]] == ["a", "b"]


def test_tool_round_trip_merges_consecutive_tool_results_into_one_user_turn():
    out = translate(
        [
            {"role": "user", "content": "weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "24C", "cache_control": EPHEMERAL}],
            },
            {"role": "user", "content": "thanks"},
        ]
    )
    assert [turn["role"] for turn in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][1]["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}},
    ]
    assert out["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
        {
            "type": "tool_result",
            "tool_use_id": "call_2",
            "content": [{"type": "text", "text": "24C", "cache_control": EPHEMERAL}],
        },
        {"type": "text", "text": "thanks"},
    ]


def test_tool_results_are_moved_before_text_in_a_merged_user_turn():
    out = translate(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": ""}}
                ],
            },
            {"role": "user", "content": "by the way"},
            {"role": "tool", "tool_call_id": "t1", "content": "done"},
        ]
    )
    assert out["messages"][0]["content"] == [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    ]
    assert [b["type"] for b in out["messages"][1]["content"]] == ["tool_result", "text"]


@pytest.mark.parametrize("arguments", ['{"city": ', "[1, 2]", "not json"])
def test_invalid_tool_call_arguments_raise_with_param(arguments):
    with pytest.raises(TranslationError) as info:
        translate(
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": arguments},
                        }
                    ],
                },
            ]
        )
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


def test_images_data_url_becomes_base64_and_http_url_becomes_url_source():
    out = translate(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                    {
                        "type": "image_url",
                        "image_url": {"url": "https://example.com/cat.jpg", "detail": "high"},
                        "cache_control": EPHEMERAL,
                    },
                ],
            },
        ]
    )
    assert out["messages"][0]["content"][1:] == [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
        {
            "type": "image",
            "source": {"type": "url", "url": "https://example.com/cat.jpg"},
            "cache_control": EPHEMERAL,
        },
    ]


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "data:image/png,rawbytes", "data:image/bmp;base64,AAAA"]
)
def test_unusable_image_urls_raise_with_param(url):
    with pytest.raises(TranslationError) as info:
        translate([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert info.value.param == "messages[0].content[0].image_url.url"


def test_pdf_file_part_becomes_document_block():
    out = translate(
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "file",
                        "file": {
                            "filename": "a.pdf",
                            "file_data": "data:application/pdf;base64,JVBE",
                        },
                    }
                ],
            }
        ]
    )
    assert out["messages"][0]["content"] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
        }
    ]


def test_tools_translate_with_cache_control_and_default_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Get weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}, "cache_control": EPHEMERAL},
    ]
    out = translate([{"role": "user", "content": "x"}], tools=tools)
    assert out["tools"] == [
        {
            "name": "weather",
            "description": "Get weather",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        {
            "name": "now",
            "input_schema": {"type": "object", "properties": {}},
            "cache_control": EPHEMERAL,
        },
    ]
    assert "tool_choice" not in out


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "choice, parallel, expected",
    [
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("none", False, {"type": "none"}),
        (None, True, None),
    ],
)
def test_tool_choice_variants(choice, parallel, expected):
    fields = {"tools": TOOLS}
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    out = translate([{"role": "user", "content": "x"}], **fields)
    assert out.get("tool_choice") == expected


def test_bad_tool_choice_raises():
    with pytest.raises(TranslationError) as info:
        translate([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="sometimes")
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("function", ["f", ["f"], 3, {"name": 3}, {}])
def test_tool_choice_function_of_wrong_shape_raises_with_param(function):
    with pytest.raises(TranslationError) as info:
        translate(
            [{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": function},
        )
    assert info.value.param == "tool_choice.function.name"


def test_sampling_fields_stop_stream_user_and_max_tokens():
    out = translate(
        [{"role": "user", "content": "x"}],
        max_tokens=100,
        max_completion_tokens=50,
        temperature=1.7,
        top_p=0.9,
        stop="END",
        stream=True,
        stream_options={"include_usage": True},
        user="u-42",
        seed=7,
        presence_penalty=0.5,
        logprobs=False,
        metadata={"k": "v"},
        top_k=5,
    )
    assert out == {
        "model": MODEL,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "stop_sequences": ["END"],
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 5,
        "metadata": {"user_id": "u-42"},
        "stream": True,
    }
    assert translate([{"role": "user", "content": "x"}], stop=["a", "b"], max_tokens=9)[
        "stop_sequences"
    ] == ["a", "b"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [1]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
        ),
    ],
)
def test_untranslatable_fields_raise_with_param(fields, param):
    with pytest.raises(TranslationError) as info:
        translate([{"role": "user", "content": "x"}], **fields)
    assert info.value.param == param


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0]"),
        (
            [
                {
                    "role": "system",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                }
            ],
            "messages[0].content",
        ),
    ],
)
def test_malformed_messages_raise_with_param(messages, param):
    with pytest.raises(TranslationError) as info:
        translate(messages)
    assert info.value.param == param


def test_translation_is_deterministic_and_does_not_mutate_the_input():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s", "cache_control": EPHEMERAL},
            {
                "role": "user",
                "content": [{"type": "text", "text": "u", "cache_control": EPHEMERAL}],
            },
        ],
        "tools": TOOLS,
    }
    snapshot = orjson.dumps(body)
    first = orjson.dumps(to_anthropic_request(body, MODEL))
    assert orjson.dumps(to_anthropic_request(body, MODEL)) == first
    assert orjson.dumps(body) == snapshot


# --- whole responses --------------------------------------------------------------------------


def anthropic_message(content: list[dict], stop_reason: str = "end_turn", **usage) -> dict:
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, **usage},
    }


def test_response_with_text_thinking_tool_use_and_cache_usage():
    resp = anthropic_message(
        [
            {"type": "thinking", "thinking": "Need weather.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "weather",
                "input": {"city": "Paris", "n": 1},
            },
        ],
        stop_reason="tool_use",
        cache_read_input_tokens=1000,
        cache_creation_input_tokens=200,
    )
    out = to_openai_response(resp, "claude-client", created=123)
    assert out["id"] == "msg_01" and out["created"] == 123 and out["model"] == "claude-client"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert choice["message"]["reasoning_content"] == "Need weather."
    assert choice["message"]["tool_calls"] == [
        {
            "id": "toolu_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris","n":1}'},
        }
    ]
    assert out["usage"] == {
        "prompt_tokens": 1210,
        "completion_tokens": 5,
        "total_tokens": 1215,
        "prompt_tokens_details": {"cached_tokens": 1000, "cache_write_tokens": 200},
        "cache_creation_input_tokens": 200,
    }
    parsed = ChatCompletion.model_validate(out)
    assert parsed.choices[0].message.tool_calls[0].function.name == "weather"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1000


# Anthropic stop_reason -> OpenAI finish_reason, the same for whole responses and streams.
STOP_REASONS = [
    ("end_turn", "stop"),
    ("stop_sequence", "stop"),
    ("max_tokens", "length"),
    ("tool_use", "tool_calls"),
    ("pause_turn", "stop"),
    ("refusal", "content_filter"),
    ("something_new", "stop"),
]


@pytest.mark.parametrize("stop_reason, finish", STOP_REASONS)
def test_response_stop_reasons(stop_reason, finish):
    out = to_openai_response(anthropic_message([{"type": "text", "text": "x"}], stop_reason), "m")
    assert out["choices"][0]["finish_reason"] == finish
    ChatCompletion.model_validate(out)


def test_response_with_only_tool_use_has_null_content():
    resp = anthropic_message(
        [{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "tool_use"
    )
    message = to_openai_response(resp, "m")["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == "{}"


# --- streams ----------------------------------------------------------------------------------


def message_start(**usage) -> tuple[str, dict]:
    return "message_start", {
        "type": "message_start",
        "message": {
            "id": "msg_s1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 25, "output_tokens": 1, **usage},
        },
    }


def block_start(index: int, block: dict) -> tuple[str, dict]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }


def block_delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def block_stop(index: int) -> tuple[str, dict]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def message_delta(stop_reason: str, output_tokens: int) -> tuple[str, dict]:
    return "message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }


MESSAGE_STOP = ("message_stop", {"type": "message_stop"})
PING = ("ping", {"type": "ping"})


def run(
    events: list[tuple[str, dict]], include_usage: bool = True
) -> tuple[list[dict], AnthropicStreamTranslator]:
    translator = AnthropicStreamTranslator("claude-client", include_usage=include_usage, created=77)
    chunks = [chunk for name, data in events for chunk in translator.feed(name, data)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)  # every chunk must parse in the real SDK
    return chunks, translator


def deltas(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def test_text_stream_event_by_event():
    translator = AnthropicStreamTranslator("claude-client", include_usage=False, created=77)
    first = translator.feed(*message_start())
    assert first == [
        {
            "id": "msg_s1",
            "object": "chat.completion.chunk",
            "created": 77,
            "model": "claude-client",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    ]
    assert not chunk_has_content(first[0])  # the role chunk is not the first token
    assert translator.feed(*block_start(0, {"type": "text", "text": ""})) == []
    assert translator.feed(*PING) == []
    hello = translator.feed(*block_delta(0, {"type": "text_delta", "text": "Hello"}))
    assert [c["choices"][0]["delta"] for c in hello] == [{"content": "Hello"}]
    assert chunk_has_content(hello[0])
    world = translator.feed(*block_delta(0, {"type": "text_delta", "text": " world"}))
    assert world[0]["choices"][0]["delta"] == {"content": " world"}
    assert translator.feed(*block_stop(0)) == []
    end = translator.feed(*message_delta("end_turn", 12))
    assert end[0]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert translator.feed(*MESSAGE_STOP) == []  # the client did not ask for usage...
    assert translator.usage["completion_tokens"] == 12  # ...but the gateway still knows it
    assert translator.usage["prompt_tokens"] == 25
    assert {c["id"] for c in first + hello + world + end} == {"msg_s1"}


def test_request_id_overrides_message_id():
    translator = AnthropicStreamTranslator("m", include_usage=False, request_id="chatcmpl-abc")
    assert translator.feed(*message_start())[0]["id"] == "chatcmpl-abc"


def test_parallel_tool_use_stream_with_json_fragments():
    events = [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        block_delta(0, {"type": "text_delta", "text": "Checking both."}),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {}}),
        block_delta(1, {"type": "input_json_delta", "partial_json": ""}),
        block_delta(1, {"type": "input_json_delta", "partial_json": '{"city": "Pa'}),
        block_delta(1, {"type": "input_json_delta", "partial_json": 'ris"}'}),
        block_stop(1),
        block_start(2, {"type": "tool_use", "id": "toolu_b", "name": "weather", "input": {}}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '{"city":'}),
        PING,
        block_delta(2, {"type": "input_json_delta", "partial_json": ' "Rome"}'}),
        block_stop(2),
        message_delta("tool_use", 40),
        MESSAGE_STOP,
    ]
    chunks, _ = run(events)
    tool_deltas = [d["tool_calls"][0] for d in deltas(chunks) if "tool_calls" in d]
    assert tool_deltas == [
        {
            "index": 0,
            "id": "toolu_a",
            "type": "function",
            "function": {"name": "weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"city": "Pa'}},
        {"index": 0, "function": {"arguments": 'ris"}'}},
        {
            "index": 1,
            "id": "toolu_b",
            "type": "function",
            "function": {"name": "weather", "arguments": ""},
        },
        {"index": 1, "function": {"arguments": '{"city":'}},
        {"index": 1, "function": {"arguments": ' "Rome"}'}},
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    # Reassemble the way an OpenAI client does and check the arguments are the intended JSON.
    arguments: dict[int, str] = {}
    for call in tool_deltas:
        arguments[call["index"]] = arguments.get(call["index"], "") + call["function"]["arguments"]
    assert [orjson.loads(arguments[i]) for i in (0, 1)] == [{"city": "Paris"}, {"city": "Rome"}]


def test_thinking_stream_becomes_reasoning_content():
    chunks, _ = run(
        [
            message_start(),
            block_start(0, {"type": "thinking", "thinking": ""}),
            block_delta(0, {"type": "thinking_delta", "thinking": "Let me think"}),
            block_delta(0, {"type": "signature_delta", "signature": "EqQB..."}),
            block_stop(0),
            block_start(1, {"type": "text", "text": ""}),
            block_delta(1, {"type": "text_delta", "text": "42"}),
            block_stop(1),
            message_delta("end_turn", 9),
            MESSAGE_STOP,
        ]
    )
    assert deltas(chunks)[1:3] == [{"reasoning_content": "Let me think"}, {"content": "42"}]
    assert chunk_has_content(chunks[1])  # reasoning counts as the first token


def test_stream_usage_with_cache_read_and_creation():
    chunks, translator = run(
        [
            message_start(cache_read_input_tokens=2048, cache_creation_input_tokens=512),
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, {"type": "text_delta", "text": "ok"}),
            message_delta("max_tokens", 30),
            MESSAGE_STOP,
        ]
    )
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 25 + 2048 + 512,
        "completion_tokens": 30,
        "total_tokens": 25 + 2048 + 512 + 30,
        "prompt_tokens_details": {"cached_tokens": 2048, "cache_write_tokens": 512},
        "cache_creation_input_tokens": 512,
    }
    assert translator.usage == last["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    parsed = ChatCompletionChunk.model_validate(last)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2048


@pytest.mark.parametrize("stop_reason, finish", STOP_REASONS)
def test_stream_stop_reasons(stop_reason, finish):
    chunks, _ = run(
        [message_start(), message_delta(stop_reason, 1), MESSAGE_STOP], include_usage=False
    )
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, finish]


def test_error_event_raises_with_message_and_type():
    translator = AnthropicStreamTranslator("m", include_usage=True)
    translator.feed(*message_start())
    partial = translator.feed(*block_delta(0, {"type": "text_delta", "text": "par"}))
    assert deltas(partial) == [{"content": "par"}]
    with pytest.raises(AnthropicStreamError) as info:
        translator.feed(
            "error",
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        )
    assert (info.value.message, info.value.type) == ("Overloaded", "overloaded_error")
    assert info.value.to_openai()["error"]["type"] == "overloaded_error"


def test_events_of_unexpected_shape_are_ignored_like_unknown_fields():
    translator = AnthropicStreamTranslator("m", include_usage=True)
    translator.feed("message_start", {"type": "message_start", "message": "odd"})
    translator.feed("message_delta", {"type": "message_delta", "delta": [1], "usage": "x"})
    translator.feed("content_block_delta", {"type": "content_block_delta", "delta": None})
    chunks = translator.feed(
        "message_delta", {"delta": {"stop_reason": ["?"]}, "usage": {"output_tokens": -3}}
    )
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    assert translator.usage["completion_tokens"] == 0


def test_usage_fields_of_the_wrong_type_count_as_zero_one_by_one():
    usage = openai_usage(
        {
            "input_tokens": 4,
            "output_tokens": "abc",
            "cache_read_input_tokens": [1],
            "cache_creation_input_tokens": -2,
        }
    )
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 0)
    assert openai_usage("junk")["total_tokens"] == 0


def test_event_name_falls_back_to_data_type_and_unknown_events_are_ignored():
    translator = AnthropicStreamTranslator("m", include_usage=False)
    assert translator.feed("", message_start()[1])[0]["choices"][0]["delta"]["role"] == "assistant"
    assert translator.feed("brand_new_event", {"type": "brand_new_event"}) == []
    assert translator.feed(*block_delta(0, {"type": "citations_delta", "citation": {}})) == []


# --- errors -----------------------------------------------------------------------------------


def test_error_body_keeps_anthropic_message_and_type():
    body = orjson.dumps(
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: too large"},
        }
    )
    assert error_to_openai(400, body) == {
        "error": {
            "message": "max_tokens: too large",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


@pytest.mark.parametrize(
    "status, body, expected_type, message_part",
    [
        (529, b"<html>busy</html>", "overloaded_error", "busy"),
        (503, b"", "api_error", "HTTP 503"),
        (429, b'{"error": "slow down"}', "rate_limit_error", "slow down"),
    ],
)
def test_error_body_that_is_not_anthropic_json(status, body, expected_type, message_part):
    error = error_to_openai(status, body)["error"]
    assert error["type"] == expected_type and message_part in error["message"]


def test_openai_sdk_stream_state_reassembles_text_and_parallel_tool_calls():
    """The SDK's own accumulator (what `client.chat.completions.stream()` uses) rebuilds the
    final completion from our chunks: content, both tool calls with whole arguments, usage."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    chunks, _ = run(
        [
            message_start(cache_read_input_tokens=100),
            block_start(0, {"type": "text", "text": ""}),
            block_delta(0, {"type": "text_delta", "text": "Two "}),
            block_delta(0, {"type": "text_delta", "text": "calls."}),
            block_start(1, {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {}}),
            block_delta(1, {"type": "input_json_delta", "partial_json": '{"a": 1, '}),
            block_delta(1, {"type": "input_json_delta", "partial_json": '"b": 2}'}),
            block_start(2, {"type": "tool_use", "id": "toolu_b", "name": "mul", "input": {}}),
            block_delta(2, {"type": "input_json_delta", "partial_json": '{"a": 3}'}),
            message_delta("tool_use", 17),
            MESSAGE_STOP,
        ]
    )
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Two calls."
    assert [
        (c.id, c.function.name, orjson.loads(c.function.arguments)) for c in message.tool_calls
    ] == [("toolu_a", "add", {"a": 1, "b": 2}), ("toolu_b", "mul", {"a": 3})]
    assert final.choices[0].finish_reason == "tool_calls"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (125, 17)
