"""OpenAI <-> Gemini `generateContent` translation, request by request and chunk by chunk; the
answers are validated by the OpenAI SDK's own types."""

from __future__ import annotations

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.translation.gemini import (
    SIGNATURE_SEPARATOR,
    GeminiStreamTranslator,
    TranslationError,
    error_to_openai,
    openai_usage,
    to_gemini_request,
    to_openai_response,
)


def translate(messages: list[dict], **fields) -> dict:
    return to_gemini_request({"model": "gemini-x", "messages": messages, **fields})


# --- requests ---------------------------------------------------------------------------------


def test_system_and_developer_go_to_system_instruction_and_roles_alternate():
    out = translate(
        [
            {"role": "system", "content": "A."},
            {"role": "developer", "content": [{"type": "text", "text": "B."}]},
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "three"},
        ]
    )
    assert out["systemInstruction"] == {"parts": [{"text": "A."}, {"text": "B."}]}
    assert out["contents"] == [
        {"role": "user", "parts": [{"text": "one"}, {"text": "two"}]},
        {"role": "model", "parts": [{"text": "three"}]},
    ]
    assert "generationConfig" not in out and "tools" not in out


def test_media_parts():
    out = translate(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                    {"type": "image_url", "image_url": {"url": "https://x.test/cat.jpg?s=1"}},
                    {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                    {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE"}},
                ],
            }
        ]
    )
    assert out["contents"][0]["parts"] == [
        {"inlineData": {"mimeType": "image/png", "data": "iVBO"}},
        {"fileData": {"mimeType": "image/jpeg", "fileUri": "https://x.test/cat.jpg?s=1"}},
        {"inlineData": {"mimeType": "audio/wav", "data": "UklG"}},
        {"inlineData": {"mimeType": "application/pdf", "data": "JVBE"}},
    ]


@pytest.mark.parametrize(
    ("choice", "config"),
    [
        ("auto", {"mode": "AUTO"}),
        ("none", {"mode": "NONE"}),
        ("required", {"mode": "ANY"}),
    ],
)
def test_tool_choice(choice, config):
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = translate([{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
    assert out["tools"] == [{"functionDeclarations": [{"name": "f"}]}]
    assert out["toolConfig"] == {"functionCallingConfig": config}


def test_generation_config_and_native_fields():
    out = translate(
        [{"role": "user", "content": "x"}],
        temperature=1.5,
        top_p=0.9,
        max_completion_tokens=10,
        max_tokens=99,
        stop="END",
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logprobs=True,
        top_logprobs=3,
        response_format={"type": "json_object"},
        user="u-1",
        parallel_tool_calls=False,
        safetySettings=[{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        cachedContent="cachedContents/abc",
        generationConfig={"thinkingConfig": {"thinkingBudget": 0}},
    )
    assert out["generationConfig"] == {
        "temperature": 1.5,
        "topP": 0.9,
        "presencePenalty": 0.5,
        "frequencyPenalty": 0.25,
        "maxOutputTokens": 10,
        "stopSequences": ["END"],
        "seed": 7,
        "responseLogprobs": True,
        "logprobs": 3,
        "responseMimeType": "application/json",
        "thinkingConfig": {"thinkingBudget": 0},
    }
    assert out["cachedContent"] == "cachedContents/abc"
    assert out["safetySettings"][0]["threshold"] == "BLOCK_NONE"
    assert "user" not in out and "parallel_tool_calls" not in out


def test_translation_is_deterministic():
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "stop": ["a"]}
    assert orjson.dumps(to_gemini_request(body)) == orjson.dumps(to_gemini_request(dict(body)))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, None),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"}]}, None),
    ],
)
def test_untranslatable_requests_name_the_field(fields, param):
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(TranslationError) as caught:
        to_gemini_request(body)
    if param is not None:
        assert caught.value.param == param


# --- answers ----------------------------------------------------------------------------------


def candidate(parts: list[dict], finish: str | None = None, index: int = 0) -> dict:
    out: dict = {"content": {"role": "model", "parts": parts}, "index": index}
    if finish:
        out["finishReason"] = finish
    return out


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("STOP", "stop"),
        ("MAX_TOKENS", "length"),
        ("SAFETY", "content_filter"),
        ("RECITATION", "content_filter"),
        ("PROHIBITED_CONTENT", "content_filter"),
        ("MALFORMED_FUNCTION_CALL", "stop"),
        ("OTHER", "stop"),
    ],
)
def test_finish_reasons(reason, expected):
    resp = {"candidates": [candidate([{"text": "x"}], reason)]}
    out = to_openai_response(resp, "gemini-x", request_id="chatcmpl-1", created=1)
    ChatCompletion.model_validate(out)
    assert out["choices"][0]["finish_reason"] == expected


def test_whole_answer_with_thoughts_calls_and_usage():
    parts = [
        {"text": "thinking...", "thought": True},
        {"text": "Hi"},
        {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": "c2ln"},
    ]
    usage = {
        "promptTokenCount": 2000,
        "candidatesTokenCount": 10,
        "thoughtsTokenCount": 30,
        "totalTokenCount": 2040,
        "cachedContentTokenCount": 1536,
    }
    resp = {"candidates": [candidate(parts, "STOP")], "usageMetadata": usage}
    out = to_openai_response(resp, "gemini-x", request_id="chatcmpl-1", created=1)
    ChatCompletion.model_validate(out)
    message = out["choices"][0]["message"]
    assert message["content"] == "Hi" and message["reasoning_content"] == "thinking..."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert call["id"].startswith("call_") and call["id"].endswith(SIGNATURE_SEPARATOR + "c2ln")
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["usage"]["prompt_tokens"] == 2000
    assert out["usage"]["completion_tokens"] == 40
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 1536}
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 30}
    assert out["usage"]["usageMetadata"] == usage


def test_blocked_prompt_is_a_content_filter_finish():
    resp = {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 3}}
    out = to_openai_response(resp, "gemini-x", request_id="chatcmpl-1", created=1)
    assert out["choices"][0]["finish_reason"] == "content_filter"
    translator = GeminiStreamTranslator("gemini-x", request_id="chatcmpl-1", created=1)
    chunks = translator.feed(resp)
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter" and translator.finished


def test_untrusted_usage_counts_read_as_zero():
    usage = openai_usage({"promptTokenCount": -5, "cachedContentTokenCount": "9", "x": True})
    assert usage["prompt_tokens"] == 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_stream_translation_two_candidates_and_usage_last():
    translator = GeminiStreamTranslator("gemini-x", request_id="chatcmpl-1", created=1)
    first = translator.feed(
        {
            "candidates": [candidate([{"text": "a"}]), candidate([{"text": "b"}], index=1)],
            "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 1},
        }
    )
    assert not translator.finished
    second = translator.feed(
        {
            "candidates": [
                candidate([{"functionCall": {"name": "f", "args": {}}}], "STOP"),
                candidate([{"text": "c"}], "MAX_TOKENS", index=1),
            ],
            "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 3},
        }
    )
    for chunk in [*first, *second]:
        ChatCompletionChunk.model_validate(chunk)
    assert translator.finished
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in second
        if c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "tool_calls", 1: "length"}
    (call_chunk,) = [c for c in second if c["choices"][0]["delta"].get("tool_calls")]
    assert call_chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    usage = translator.usage_chunk()
    assert usage is not None and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_google_error_bodies():
    body = orjson.dumps(
        {
            "error": {
                "code": 429,
                "message": "Quota exceeded",
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "12.5s"}
                ],
            }
        }
    )
    status, payload, retry_after = error_to_openai(429, body)
    assert status == 429 and retry_after == 12.5
    assert payload["error"]["type"] == "rate_limit_error"
    assert payload["error"]["code"] == "resource_exhausted"
    unavailable = orjson.dumps({"error": {"code": 503, "message": "x", "status": "UNAVAILABLE"}})
    assert error_to_openai(503, unavailable)[0] == 503
    status, payload, _ = error_to_openai(502, b"<html>bad gateway</html>")
    assert status == 502 and "bad gateway" in payload["error"]["message"]


def test_logprobs_result_becomes_openai_logprobs():
    result = {
        "topCandidates": [
            {
                "candidates": [
                    {"token": "Hi", "logProbability": -0.1},
                    {"token": "Yo", "logProbability": -2.5},
                ]
            }
        ],
        "chosenCandidates": [{"token": "Hi", "logProbability": -0.1}],
    }
    resp = {"candidates": [{**candidate([{"text": "Hi"}], "STOP"), "logprobsResult": result}]}
    out = to_openai_response(resp, "gemini-x", request_id="chatcmpl-1", created=1)
    ChatCompletion.model_validate(out)
    (step,) = out["choices"][0]["logprobs"]["content"]
    assert step["token"] == "Hi" and step["logprob"] == -0.1
    assert [t["token"] for t in step["top_logprobs"]] == ["Hi", "Yo"]
    translator = GeminiStreamTranslator("gemini-x", request_id="chatcmpl-1", created=1)
    chunks = translator.feed(resp)
    with_logprobs = [c for c in chunks if c["choices"][0]["logprobs"]]
    assert with_logprobs[0]["choices"][0]["delta"] == {"content": "Hi"}


@pytest.mark.parametrize(
    ("model", "effort", "thinking"),
    [
        ("gemini-2.5-flash", "none", {"thinkingBudget": 0}),
        ("gemini-2.5-pro", "medium", {"thinkingBudget": 8192}),
        ("gemini-3-pro-preview", "high", {"thinkingLevel": "high"}),
        ("gemini-3-pro-preview", "none", None),
        ("gemini-2.0-flash", "high", None),
    ],
)
def test_reasoning_effort_becomes_thinking_config(model, effort, thinking):
    body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
    out = to_gemini_request({**body, "reasoning_effort": effort})
    assert out.get("generationConfig", {}).get("thinkingConfig") == thinking
