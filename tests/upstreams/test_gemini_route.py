"""A `gemini` route through the gateway with the real OpenAI SDK, against a mock of the Gemini
API at its wire format: what the SDK gets, what Google received, what telemetry kept."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import openai
import pytest

from bench.mock_google import SIGNATURE
from tests.support.gateway import capture_events, wait_for
from tests.upstreams.google_support import GEMINI_KEY_ENV, origin

KEY = "gm-secret-key"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "additionalProperties": False,
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
]


def gemini_gateway(make_gateway, google, **settings):
    route = {
        "name": "gemini",
        "models": ["gemini-*"],
        "kind": "gemini",
        "base_url": origin(google),
        "api_key_env": GEMINI_KEY_ENV,
    }
    return make_gateway([route], environ={GEMINI_KEY_ENV: KEY}, **settings)


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="client-key", max_retries=0, timeout=20)


def test_stream_text_usage_and_wire(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    events = capture_events(gw)
    stream = client(gw).chat.completions.create(
        model="gemini-2.5-flash",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.2,
        max_tokens=50,
        stop=["END"],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from Gemini"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert not chunks[-1].choices
    assert usage.prompt_tokens == 1200 and usage.completion_tokens == 4
    assert usage.prompt_tokens_details.cached_tokens == 1024
    assert usage.model_extra["usageMetadata"]["cachedContentTokenCount"] == 1024
    (sent,) = google.mock.requests
    assert sent["path"] == "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    assert sent["query"] == "alt=sse"
    assert sent["headers"]["x-goog-api-key"] == KEY
    assert "authorization" not in sent["headers"]
    body = sent["body"]
    assert body["systemInstruction"] == {"parts": [{"text": "You are a weather bot."}]}
    assert body["contents"] == [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}]
    assert body["generationConfig"] == {
        "temperature": 0.2,
        "maxOutputTokens": 50,
        "stopSequences": ["END"],
    }
    assert "model" not in body and "stream_options" not in body
    (event,) = wait_for(events, route="gemini")
    assert event.cached_prompt_tokens == 1024 and event.prompt_tokens == 1200
    assert event.status == "ok" and event.ttft_s is not None


def test_stream_without_include_usage_has_no_usage_chunk(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    chunks = list(
        client(gw).chat.completions.create(model="gemini-2.5-flash", messages=MESSAGES, stream=True)
    )
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_complete_and_json_schema(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    answer = client(gw).chat.completions.create(
        model="gemini-2.5-flash",
        messages=MESSAGES,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert answer.choices[0].message.content == "Hello from Gemini"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.model == "gemini-2.5-flash"
    assert answer.usage.prompt_tokens_details.cached_tokens == 1024
    (sent,) = google.mock.requests
    assert sent["path"] == "/v1beta/models/gemini-2.5-flash:generateContent"
    config = sent["body"]["generationConfig"]
    assert config == {
        "candidateCount": 2,
        "responseMimeType": "application/json",
        "responseJsonSchema": schema,
    }


def test_tools_stream_then_tool_result_round_trip(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    chunks = list(
        client(gw).chat.completions.create(
            model="gemini-2.5-flash",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 1
    call = calls[0]
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    first = google.mock.requests[0]["body"]
    assert first["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "The weather in a city.",
                    "parametersJsonSchema": TOOLS[0]["function"]["parameters"],
                }
            ]
        }
    ]
    assert first["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}
    }
    # The call goes back with its result: Gemini gets the functionCall (its thought signature
    # too) and a functionResponse named after the function.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": call.function.arguments},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}
    answer = client(gw).chat.completions.create(
        model="gemini-2.5-flash", messages=[*MESSAGES, assistant, tool], tools=TOOLS
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    contents = google.mock.requests[1]["body"]["contents"]
    assert contents[1] == {
        "role": "model",
        "parts": [
            {
                "functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
                "thoughtSignature": SIGNATURE,
            }
        ],
    }
    assert contents[2] == {
        "role": "user",
        "parts": [{"functionResponse": {"name": "get_weather", "response": {"temp_c": 21}}}],
    }


@pytest.mark.parametrize(
    ("status", "client_status", "error_type"),
    [
        (400, 400, "invalid_request_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
    ],
)
def test_google_errors_are_openai_shaped(
    make_gateway, google, caplog, status, client_status, error_type
):
    caplog.set_level(logging.DEBUG)
    gw = gemini_gateway(make_gateway, google)
    google.mock.behaviour.fail_statuses = [status]
    google.mock.behaviour.fail_message = f"mock {status} for {KEY}"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "gemini-2.5-flash", "messages": MESSAGES},
        timeout=20,
    )
    assert r.status_code == client_status
    error = r.json()["error"]
    assert error["type"] == error_type and error["message"].startswith(f"mock {status}")
    assert KEY not in r.text  # the key an upstream message echoes is blanked
    assert KEY not in caplog.text and KEY not in httpx.get(gw.url + "/metrics").text


def test_throttling_is_a_429_with_retry_after(make_gateway, google):
    gw = gemini_gateway(make_gateway, google, retry_attempts=1)
    google.mock.behaviour.fail_statuses = [429]
    google.mock.behaviour.retry_delay = "17s"
    with pytest.raises(openai.RateLimitError) as caught:
        client(gw).chat.completions.create(model="gemini-2.5-flash", messages=MESSAGES)
    assert caught.value.response.headers["retry-after"] == "17"
    assert caught.value.body["type"] == "rate_limit_error"
    assert caught.value.body["code"] == "resource_exhausted"


def test_unavailable_is_retried_before_the_first_byte(make_gateway, google):
    gw = gemini_gateway(make_gateway, google, retry_attempts=2)
    google.mock.behaviour.fail_statuses = [503]
    chunks = list(
        client(gw).chat.completions.create(model="gemini-2.5-flash", messages=MESSAGES, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello from Gemini"
    assert len(google.mock.requests) == 2


def test_stream_cut_before_finish_or_with_error_event_ends_in_error(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    for flag in ("cut_before_finish", "stream_error"):
        setattr(google.mock.behaviour, flag, True)
        with pytest.raises(openai.APIError):
            list(
                client(gw).chat.completions.create(
                    model="gemini-2.5-flash", messages=MESSAGES, stream=True
                )
            )
        setattr(google.mock.behaviour, flag, False)


@pytest.mark.parametrize(
    "model",
    ["gemini-x/../../v1/files", "gemini-x:generateContent", "gemini-x?alt=json", "gemini-.."],
)
def test_model_id_must_be_one_plain_path_segment(make_gateway, google, model):
    gw = gemini_gateway(make_gateway, google)
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES},
        timeout=20,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert google.mock.requests == []


def test_responses_and_messages_doors_over_gemini(make_gateway, google):
    gw = gemini_gateway(make_gateway, google)
    response = client(gw).responses.create(model="gemini-2.5-flash", input="Weather in Paris?")
    assert response.output_text == "Hello from Gemini"
    assert response.usage.input_tokens_details.cached_tokens == 1024
    with client(gw).responses.stream(model="gemini-2.5-flash", input="Hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello from Gemini"
    claude = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0, timeout=20)
    message = claude.messages.create(
        model="gemini-2.5-flash",
        max_tokens=32,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert message.content[0].text == "Hello from Gemini"
    assert message.usage.cache_read_input_tokens == 1024
    paths = [r["path"] for r in google.mock.requests]
    assert paths == [
        "/v1beta/models/gemini-2.5-flash:generateContent",
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
        "/v1beta/models/gemini-2.5-flash:generateContent",
    ]
