"""The three providers' answers come back in one chat shape, and the two request translators
refuse the same client mistakes with the same 400: what `chat_writer` and `chat_content` are
for."""

from __future__ import annotations

import orjson
import pytest

from gateway.translation.anthropic_to_chat import AnthropicStreamTranslator
from gateway.translation.anthropic_to_chat import to_openai_response as from_anthropic
from gateway.translation.chat_to_anthropic import to_anthropic_request
from gateway.translation.chat_to_gemini import to_gemini_request
from gateway.translation.converse_to_chat import ConverseStreamTranslator
from gateway.translation.converse_to_chat import to_openai_response as from_converse
from gateway.translation.errors import TranslationError
from gateway.translation.gemini_to_chat import GeminiStreamTranslator
from gateway.translation.gemini_to_chat import to_openai_response as from_gemini

INPUT = {"city": "Oslo", "days": 3}


def whole_answers(texts: list[str], thought: str | None, call: bool) -> dict[str, dict]:
    """The same answer as each provider sends it whole."""
    anthropic = [{"type": "text", "text": t} for t in texts]
    converse = [{"text": t} for t in texts]
    gemini = [{"text": t} for t in texts]
    if thought is not None:
        anthropic.insert(0, {"type": "thinking", "thinking": thought})
        converse.insert(0, {"reasoningContent": {"reasoningText": {"text": thought}}})
        gemini.insert(0, {"text": thought, "thought": True})
    if call:
        anthropic.append({"type": "tool_use", "id": "c1", "name": "weather", "input": INPUT})
        converse.append({"toolUse": {"toolUseId": "c1", "name": "weather", "input": INPUT}})
        gemini.append({"functionCall": {"id": "c1", "name": "weather", "args": INPUT}})
    return {
        "anthropic": from_anthropic(
            {"id": "msg_1", "content": anthropic, "stop_reason": "end_turn"}, "m", created=1
        ),
        "converse": from_converse(
            {"output": {"message": {"content": converse}}, "stopReason": "end_turn"},
            "m",
            created=1,
        ),
        "gemini": from_gemini(
            {"candidates": [{"content": {"parts": gemini}, "finishReason": "STOP"}]},
            "m",
            request_id="chatcmpl-1",
            created=1,
        ),
    }


@pytest.mark.parametrize(
    ("texts", "thought", "call", "content"),
    [
        (["Hel", "lo"], None, False, "Hello"),
        ([], None, True, None),  # only a tool call: null content, as OpenAI's
        (["Let me look."], "the user wants weather", True, "Let me look."),
        ([], None, False, ""),  # nothing at all: an empty string, never null
    ],
)
def test_every_provider_writes_the_same_message(texts, thought, call, content):
    answers = whole_answers(texts, thought, call)
    for provider, answer in answers.items():
        assert answer["object"] == "chat.completion", provider
        assert answer["created"] == 1 and answer["model"] == "m", provider
        (choice,) = answer["choices"]
        message = choice["message"]
        assert choice["index"] == 0, provider
        assert message["role"] == "assistant" and message["refusal"] is None, provider
        assert message["content"] == content, provider
        assert message.get("reasoning_content") == thought, provider
        if call:
            (tool_call,) = message["tool_calls"]
            assert tool_call["type"] == "function", provider
            assert tool_call["id"] == "c1", provider
            assert tool_call["function"]["name"] == "weather", provider
            assert orjson.loads(tool_call["function"]["arguments"]) == INPUT, provider
        else:
            assert "tool_calls" not in message, provider
    # Beyond the provider's own id and usage fields, the three answers are one answer.
    shapes = {
        provider: {
            **answer,
            "id": None,
            "usage": None,
            "choices": [{**c, "finish_reason": None, "logprobs": None} for c in answer["choices"]],
        }
        for provider, answer in answers.items()
    }
    assert shapes["anthropic"] == shapes["converse"] == shapes["gemini"]


def test_a_call_without_input_sends_an_empty_object():
    anthropic = from_anthropic(
        {"content": [{"type": "tool_use", "id": "c1", "name": "now"}], "stop_reason": "tool_use"},
        "m",
    )
    gemini = from_gemini(
        {"candidates": [{"content": {"parts": [{"functionCall": {"name": "now"}}]}}]},
        "m",
        request_id="chatcmpl-1",
        created=1,
    )
    for answer in (anthropic, gemini):
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        assert call["function"]["arguments"] == "{}"
    assert anthropic["id"] and anthropic["id"].startswith("chatcmpl-")


def test_every_stream_writes_the_same_chunk_head():
    chunks = {
        "anthropic": AnthropicStreamTranslator("m", created=7, include_usage=False).feed(
            "message_start", {"message": {"id": "chatcmpl-s", "usage": {}}}
        ),
        "converse": ConverseStreamTranslator("m", created=7, request_id="chatcmpl-s").feed(
            "messageStart", {"role": "assistant"}
        ),
        "gemini": GeminiStreamTranslator("m", request_id="chatcmpl-s", created=7).feed(
            {"candidates": [{"content": {"parts": []}}]}
        ),
    }
    for provider, out in chunks.items():
        (first,) = out
        assert first == {
            "id": "chatcmpl-s",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }, provider


TRANSLATE = {
    "anthropic": lambda body: to_anthropic_request(body, "m"),
    "gemini": lambda body: to_gemini_request(body),
}


@pytest.mark.parametrize("provider", sorted(TRANSLATE))
@pytest.mark.parametrize(
    ("content", "message", "param"),
    [
        (7, "'content' must be a string or a list of parts", "messages[0].content"),
        (["hi"], "each content part must be an object", "messages[0].content[0]"),
        (
            [{"type": "text", "text": "ok"}, {"type": "text", "text": 3}],
            "a text part needs a string 'text'",
            "messages[0].content[1].text",
        ),
    ],
)
def test_both_request_translators_refuse_the_same_content_alike(provider, content, message, param):
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    with pytest.raises(TranslationError) as caught:
        TRANSLATE[provider](body)
    assert caught.value.message == message
    assert caught.value.param == param
