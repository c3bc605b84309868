"""chat <-> Bedrock Converse, both ways (pure)."""

from __future__ import annotations

import pytest

from gateway.translation.chat_to_anthropic import TranslationError
from gateway.translation.chat_to_converse import to_converse_request
from gateway.translation.converse_to_chat import ConverseStreamTranslator, converse_usage


def test_request_shape_with_images_tool_choice_and_native_fields():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                ],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "look", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "look"}},
        "top_p": 0.9,
        "seed": 7,  # no Converse counterpart: dropped
        "guardrailConfig": {"guardrailIdentifier": "g1", "guardrailVersion": "1"},
    }
    out = to_converse_request(body)
    assert out["messages"][0]["content"][1] == {
        "image": {"format": "png", "source": {"bytes": "iVBORw0KGgo="}}
    }
    assert out["toolConfig"]["toolChoice"] == {"tool": {"name": "look"}}
    assert out["inferenceConfig"] == {"topP": 0.9}
    assert out["guardrailConfig"]["guardrailIdentifier"] == "g1"
    assert "seed" not in out and "model" not in out


def test_an_image_by_url_is_a_400_naming_the_part():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                ],
            }
        ]
    }
    with pytest.raises(TranslationError, match="inline"):
        to_converse_request(body)


def test_usage_keeps_bedrock_fields_beside_openais():
    usage = converse_usage(
        {
            "inputTokens": 10,
            "outputTokens": 3,
            "cacheReadInputTokens": 1024,
            "cacheWriteInputTokens": 50,
            "totalTokens": 1087,
        }
    )
    assert usage["prompt_tokens"] == 1084 and usage["total_tokens"] == 1087
    assert usage["prompt_tokens_details"] == {"cached_tokens": 1024, "cache_write_tokens": 50}
    assert usage["cacheReadInputTokens"] == 1024
    assert converse_usage({"inputTokens": "lots"})["prompt_tokens"] == 0


def test_stream_reasoning_and_an_unknown_event_and_a_content_filter_stop():
    t = ConverseStreamTranslator("m", created=1, request_id="chatcmpl-1")
    assert t.feed("messageStart", {"role": "assistant"})[0]["choices"][0]["delta"]["role"]
    (chunk,) = t.feed("contentBlockDelta", {"delta": {"reasoningContent": {"text": "hmm"}}})
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    assert t.feed("somethingNew", {}) == []
    (stop,) = t.feed("messageStop", {"stopReason": "guardrail_intervened"})
    assert stop["choices"][0]["finish_reason"] == "content_filter" and t.stopped
