"""A `vertex` route through the gateway, against a mock of Vertex AI at its wire format and a
mock OAuth token endpoint: google-auth signs a JWT grant with a service-account key made here,
gets a token, and that token is the bearer Vertex receives. Claude models go to
`publishers/anthropic` (rawPredict, Anthropic's body and events), Gemini models to
`publishers/google` (generateContent); the OpenAI SDK and, for Claude, the Anthropic SDK on
`/v1/messages` are the clients."""

from __future__ import annotations

import json
import logging
import time

import anthropic
import httpx
import openai
import pytest

from tests.support.gateway import capture_events, wait_for
from tests.upstreams.google_support import PRIVATE_KEY_ID, origin, service_account_file

PROJECT, REGION = "mock-project", "us-east5"
PUBLISHERS = f"/v1/projects/{PROJECT}/locations/{REGION}/publishers"
LONG_SYSTEM = " ".join(["You are a careful weather bot who answers in one sentence."] * 200)
MESSAGES = [
    {"role": "system", "content": LONG_SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def vertex(make_gateway, google, tmp_path):
    return vertex_gateway(make_gateway, google, tmp_path)


def vertex_gateway(make_gateway, google, tmp_path):
    """A gateway with one vertex route to the mock, and the service account's private key."""
    path, pem = service_account_file(tmp_path, google)
    route = {
        "name": "vertex",
        "models": ["claude-*", "gemini-*"],
        "kind": "vertex",
        "project": PROJECT,
        "region": REGION,
        "base_url": origin(google),
    }
    gw = make_gateway([route], environ={"GOOGLE_APPLICATION_CREDENTIALS": str(path)})
    gw.wait_ready()
    return gw, pem


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="client-key", max_retries=0, timeout=20)


def only_request(google) -> dict:
    (sent,) = google.mock.requests
    return sent


def assert_bearer_from_google_auth(google, sent: dict) -> None:
    issued = google.mock.tokens_issued
    assert issued, "google-auth never called the token endpoint"
    assert sent["headers"]["authorization"] == f"Bearer {issued[-1]}"
    assert "x-goog-api-key" not in sent["headers"]


def test_claude_stream_over_raw_predict(vertex, google):
    gw, _ = vertex
    events = capture_events(gw)
    chunks = list(
        client(gw).chat.completions.create(
            model="claude-sonnet-4@20250514",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello from Claude"
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 1024
    sent = only_request(google)
    assert (
        sent["path"] == f"{PUBLISHERS}/anthropic/models/claude-sonnet-4@20250514:streamRawPredict"
    )
    assert_bearer_from_google_auth(google, sent)
    body = sent["body"]
    assert "model" not in body and body["anthropic_version"] == "vertex-2023-10-16"
    assert body["stream"] is True
    # cache_hints: an Anthropic model on Vertex gets Anthropic's breakpoints
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    (event,) = wait_for(events, route="vertex")
    assert event.cached_prompt_tokens == 1024 and event.status == "ok"


def test_claude_complete_with_tools(vertex, google):
    gw, _ = vertex
    answer = client(gw).chat.completions.create(
        model="claude-sonnet-4@20250514", messages=MESSAGES, tools=TOOLS
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    assert call.id == "toolu_vrtx_1" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert answer.usage.prompt_tokens_details.cached_tokens == 1024
    sent = only_request(google)
    assert sent["path"].endswith("/anthropic/models/claude-sonnet-4@20250514:rawPredict")
    assert sent["body"]["tools"][0]["name"] == "get_weather"
    assert_bearer_from_google_auth(google, sent)


def test_gemini_on_vertex_stream_and_tools(vertex, google):
    gw, _ = vertex
    chunks = list(
        client(gw).chat.completions.create(
            model="gemini-2.5-pro", messages=MESSAGES, tools=TOOLS, stream=True
        )
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    sent = only_request(google)
    assert sent["path"] == f"{PUBLISHERS}/google/models/gemini-2.5-pro:streamGenerateContent"
    assert sent["query"] == "alt=sse"
    assert_bearer_from_google_auth(google, sent)
    assert "cache_control" not in json.dumps(sent["body"])  # Gemini caches on its own


def test_gemini_on_vertex_complete(vertex, google):
    gw, _ = vertex
    answer = client(gw).chat.completions.create(model="gemini-2.5-pro", messages=MESSAGES)
    assert answer.choices[0].message.content == "Hello from Gemini"
    assert answer.usage.prompt_tokens_details.cached_tokens == 1024
    assert only_request(google)["path"].endswith("/google/models/gemini-2.5-pro:generateContent")


def claude_client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="client-key", max_retries=0, timeout=20)


def test_anthropic_sdk_messages_native_on_vertex(vertex, google):
    gw, _ = vertex
    events = capture_events(gw)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    message = claude_client(gw).messages.create(
        model="claude-sonnet-4@20250514",
        max_tokens=64,
        system=system,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
    )
    assert message.stop_reason == "tool_use" and message.id == "msg_vrtx_mock"
    assert message.usage.cache_read_input_tokens == 1024
    sent = only_request(google)
    assert sent["path"].endswith("/anthropic/models/claude-sonnet-4@20250514:rawPredict")
    body = sent["body"]
    assert "model" not in body and body["anthropic_version"] == "vertex-2023-10-16"
    assert body["system"] == system  # the client's own breakpoints, as sent
    assert_bearer_from_google_auth(google, sent)
    (event,) = wait_for(events, route="vertex", api="messages")
    assert event.cached_prompt_tokens == 1024


def test_anthropic_sdk_stream_and_breakpoints_added(vertex, google):
    gw, _ = vertex
    with claude_client(gw).messages.stream(
        model="claude-sonnet-4@20250514",
        max_tokens=64,
        system=LONG_SYSTEM,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from Claude" and final.usage.cache_read_input_tokens == 1024
    body = only_request(google)["body"]
    assert only_request(google)["path"].endswith(":streamRawPredict")
    assert body["stream"] is True and "model" not in body
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}


def test_anthropic_sdk_count_tokens_on_vertex(vertex, google):
    gw, _ = vertex
    counted = claude_client(gw).messages.count_tokens(
        model="claude-sonnet-4@20250514", messages=[{"role": "user", "content": "Hi"}]
    )
    assert counted.input_tokens == 42
    sent = only_request(google)
    assert sent["path"] == f"{PUBLISHERS}/anthropic/models/count-tokens:rawPredict"
    assert sent["body"]["model"] == "claude-sonnet-4@20250514"


def test_quota_error_is_a_429_and_no_credential_leaks(make_gateway, google, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="google")  # google-auth's own request logging too
    gw, pem = vertex_gateway(make_gateway, google, tmp_path)  # the first token fetch logged too
    token = None
    google.mock.behaviour.fail_statuses = [429] * 8  # whatever the retries take
    google.mock.behaviour.retry_delay = "0.01s"
    for model in ("claude-sonnet-4@20250514", "gemini-2.5-pro"):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": model, "messages": MESSAGES},
            timeout=20,
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        token = google.mock.tokens_issued[-1]
        assert token not in r.text and PRIVATE_KEY_ID not in r.text
    metrics = httpx.get(gw.url + "/metrics", timeout=20).text
    key_line = pem.splitlines()[1]
    for text in (caplog.text, metrics):
        assert token not in text and key_line not in text and PRIVATE_KEY_ID not in text


@pytest.mark.parametrize(
    ("status", "error_class"),
    [(429, anthropic.RateLimitError), (403, anthropic.PermissionDeniedError)],
)
def test_google_errors_reach_the_anthropic_sdk_in_anthropic_shape(
    vertex, google, status, error_class
):
    gw, _ = vertex
    google.mock.behaviour.fail_statuses = [status]
    google.mock.behaviour.fail_message = f"mock {status}"
    with pytest.raises(error_class) as caught:
        claude_client(gw).messages.create(
            model="claude-sonnet-4@20250514",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
        )
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["message"] == f"mock {status}"


def test_responses_door_over_vertex_claude(vertex, google):
    gw, _ = vertex
    response = client(gw).responses.create(model="claude-sonnet-4@20250514", input="Hi")
    assert response.output_text == "Hello from Claude"
    assert response.usage.input_tokens_details.cached_tokens == 1024
    assert only_request(google)["path"].endswith(":rawPredict")


def test_the_gateway_refreshes_the_token_before_it_expires(make_gateway, google, tmp_path):
    # Tokens that last 301 s are due for refresh one second after each grant (the default
    # margin is 300 s): the background task refreshes, and requests carry the new token.
    google.mock.behaviour.token_expires_in = 301
    gw, _ = vertex_gateway(make_gateway, google, tmp_path)
    deadline = time.monotonic() + 20
    while len(google.mock.tokens_issued) < 2:
        assert time.monotonic() < deadline, "no background refresh"
        time.sleep(0.05)
    client(gw).chat.completions.create(model="gemini-2.5-pro", messages=MESSAGES)
    sent = only_request(google)
    assert sent["headers"]["authorization"] != "Bearer ya29.mock-1"
    bearer = sent["headers"]["authorization"].removeprefix("Bearer ")
    assert bearer in google.mock.tokens_issued[1:]
    assert gw.runtime.upstreams["vertex"].tokens.waited == 0  # no request waited on a refresh
