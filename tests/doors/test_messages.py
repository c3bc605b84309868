"""`POST /v1/messages` and `/v1/messages/count_tokens` through the gateway with the real
`anthropic` SDK: what the SDK gets back, what the upstream received, and what telemetry kept."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

from tests.support.gateway import anthropic_route, capture_events, openai_route, wait_for

KEYS = "acme:key-a,globex:key-b"
UPSTREAM_KEY = "sk-upstream-secret"  # what make_gateway puts in MOCK_KEY
SYSTEM = [
    {
        "type": "text",
        "text": " ".join(["You are a weather bot."] * 20),
        "cache_control": {"type": "ephemeral"},
    }
]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
]
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}
        ],
    }
]


def claude_client(gw, key: str = "client-key", **options) -> anthropic.Anthropic:
    """An `anthropic.Anthropic` pointed at the gateway; no SDK retries, a short timeout."""
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20, **options)


def message_posts(mock_upstream, path: str = "/v1/messages") -> list[dict]:
    return [r for r in mock_upstream.mock.requests if r["path"] == path]


def test_create_with_tools_keeps_cache_control_as_sent(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)], tenant_keys=KEYS)
    client = claude_client(gw, "key-a")
    message = client.messages.create(
        model="claude-x", max_tokens=64, system=SYSTEM, tools=TOOLS, messages=MESSAGES
    )
    assert message.stop_reason == "tool_use"
    tool = [block for block in message.content if block.type == "tool_use"]
    assert tool and tool[0].name == "get_weather" and tool[0].input == {"city": "Paris"}
    assert message.usage.cache_read_input_tokens == 100
    (sent,) = message_posts(mock_upstream)
    body = sent["body"]
    assert body["system"] == SYSTEM and body["tools"] == TOOLS and body["messages"] == MESSAGES
    assert body["model"] == "claude-x" and "stream" not in body
    headers = {k.lower(): v for k, v in sent["headers"].items()}
    assert headers["x-api-key"] == UPSTREAM_KEY
    assert headers["anthropic-version"] == client.default_headers["anthropic-version"]
    assert "authorization" not in headers
    assert not any("key-a" in v for v in headers.values())


def test_model_map_renames_the_model_upstream_only(mock_upstream, make_gateway):
    route = anthropic_route(mock_upstream, model_map={"claude-x": "claude-upstream-name"})
    gw = make_gateway([route])
    message = claude_client(gw).messages.create(
        model="claude-x", max_tokens=16, system=SYSTEM, messages=MESSAGES
    )
    assert message.content[0].text == "Hello from Claude"
    (sent,) = message_posts(mock_upstream)
    assert sent["body"]["model"] == "claude-upstream-name"
    assert sent["body"]["system"] == SYSTEM  # re-encoded, unchanged


def test_stream_relays_text_and_usage(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    with claude_client(gw).messages.stream(
        model="claude-x", max_tokens=32, messages=MESSAGES
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from Claude"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3 and final.usage.cache_read_input_tokens == 100
    (sent,) = message_posts(mock_upstream)
    assert sent["body"]["stream"] is True


def test_stream_is_sse_with_ping_passed_and_nothing_rewritten(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    body = {"model": "claude-x", "max_tokens": 8, "stream": True, "messages": MESSAGES}
    r = httpx.post(gw.url + "/v1/messages", json=body, timeout=20)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in r.text.split("\n") if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "ping" in names and names.count("content_block_delta") == 3
    assert r.headers["x-request-id"].startswith("req_")


def test_count_tokens(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    counted = claude_client(gw).messages.count_tokens(
        model="claude-x", messages=MESSAGES, system=SYSTEM
    )
    assert counted.input_tokens > 0
    (sent,) = message_posts(mock_upstream, "/v1/messages/count_tokens")
    assert sent["body"]["messages"] == MESSAGES and sent["body"]["system"] == SYSTEM


def test_tenant_key_by_x_api_key_or_bearer_and_bad_key_is_401(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)], tenant_keys=KEYS)
    assert (
        claude_client(gw, "key-b")
        .messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
        .content
    )
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token="key-b", max_retries=0, timeout=20)
    assert bearer.messages.create(model="claude-x", max_tokens=8, messages=MESSAGES).content
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude_client(gw, "wrong-key").messages.create(
            model="claude-x", max_tokens=8, messages=MESSAGES
        )
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert len(message_posts(mock_upstream)) == 2


# -- openai routes: translated to chat -----------------------------------------------------------

CHAT = "/v1/chat/completions"
PLAIN_TOOLS = [{k: v for k, v in TOOLS[0].items() if k != "cache_control"}]


def test_openai_route_serves_messages_translated_with_tools(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.tool_call = True
    mock_upstream.mock.behaviour.cached_tokens = 4
    gw = make_gateway([anthropic_route(mock_upstream), openai_route(mock_upstream)])
    message = claude_client(gw).messages.create(
        model="gpt-4o", max_tokens=30, system="Be brief.", tools=PLAIN_TOOLS, messages=MESSAGES
    )
    assert message.model == "gpt-4o" and message.stop_reason == "tool_use"
    (tool,) = [block for block in message.content if block.type == "tool_use"]
    assert tool.name == "get_weather" and tool.input == {"city": "Paris"}
    assert message.usage.cache_read_input_tokens == 4 and message.usage.input_tokens == 6
    (sent,) = message_posts(mock_upstream, CHAT)
    body = sent["body"]
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    assert body["max_tokens"] == 30
    assert message_posts(mock_upstream) == []  # never the anthropic route


def test_openai_route_streams_messages_events_and_records_ttft(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 0.05
    gw = make_gateway([openai_route(mock_upstream)])
    events = capture_events(gw)
    with claude_client(gw).messages.stream(
        model="gpt-4o", max_tokens=32, messages=MESSAGES
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5
    (event,) = wait_for(events, api="messages")
    assert event.route == "mock" and event.ttft_s is not None and event.ttft_s >= 0.045


def test_openai_route_takes_a_tool_result_round_trip_and_drops_thinking(
    mock_upstream, make_gateway
):
    gw = make_gateway([openai_route(mock_upstream)])
    history = [
        MESSAGES[0],
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user wants weather.", "signature": "s"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}],
        },
    ]
    raw = claude_client(gw).messages.with_raw_response.create(
        model="gpt-4o", max_tokens=30, tools=PLAIN_TOOLS, messages=history
    )
    assert raw.parse().content[0].type == "text"
    assert "thinking" in raw.headers["x-firsttoken-translation"]
    sent = message_posts(mock_upstream, CHAT)[0]["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == "toolu_1"
    assert sent[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}


def test_openai_route_count_tokens_is_an_estimate_that_says_so(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    resp = httpx.post(
        gw.url + "/v1/messages/count_tokens",
        json={"model": "gpt-4o", "messages": MESSAGES},
        timeout=10,
    )
    assert resp.status_code == 200 and resp.json()["input_tokens"] > 3
    assert "estimate" not in resp.json() and "cl100k" in resp.headers["x-firsttoken-estimate"]
    assert mock_upstream.mock.requests == []


def test_untranslatable_block_is_an_anthropic_400(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
    }
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude_client(gw).messages.create(
            model="gpt-4o", max_tokens=8, messages=[{"role": "user", "content": [document]}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "document" in caught.value.body["error"]["message"]  # type: ignore[index]
    assert mock_upstream.mock.requests == []


# -- policies on the Messages shape ----------------------------------------------------------

LONG_SYSTEM = " ".join(
    f"Rule {i}: answer about the weather in city number {i}." for i in range(150)
)


def test_cache_hints_add_breakpoints_only_where_the_client_set_none(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = claude_client(gw)
    client.messages.create(
        model="claude-x",
        max_tokens=8,
        system=LONG_SYSTEM,
        messages=[{"role": "user", "content": "Weather?"}],
    )
    body = message_posts(mock_upstream)[0]["body"]
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["system"][-1]["text"] == LONG_SYSTEM
    client.messages.create(model="claude-x", max_tokens=8, system=SYSTEM, messages=MESSAGES)
    assert message_posts(mock_upstream)[1]["body"]["system"] == SYSTEM  # the client's, kept


def test_unknown_model_is_a_404(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude_client(gw).messages.create(model="nobody", max_tokens=8, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_version_and_beta_pass_on_and_version_defaults(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    body = {"model": "claude-x", "max_tokens": 8, "messages": MESSAGES}
    chosen = {"anthropic-version": "2023-01-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    assert httpx.post(gw.url + "/v1/messages", json=body, headers=chosen).status_code == 200
    assert httpx.post(gw.url + "/v1/messages", json=body).status_code == 200
    first, second = (
        {k.lower(): v for k, v in r["headers"].items()} for r in message_posts(mock_upstream)
    )
    assert first["anthropic-version"] == "2023-01-01"
    assert first["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert second["anthropic-version"] == "2023-06-01" and "anthropic-beta" not in second


def test_request_id_and_rate_limit_headers_reach_the_client(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.answer_headers = {
        "request-id": "req_upstream_1",
        "anthropic-ratelimit-requests-remaining": "41",
        "set-cookie": "account=secret",
    }
    gw = make_gateway([anthropic_route(mock_upstream)])
    raw = claude_client(gw).messages.with_raw_response.create(
        model="claude-x", max_tokens=8, messages=MESSAGES
    )
    assert raw.headers["x-request-id"] == "req_upstream_1"
    assert raw.request_id == "req_upstream_1"  # what the SDK reads (`request-id`)
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "41"
    assert "set-cookie" not in raw.headers


def test_upstream_429_passes_through_and_5xx_is_ours(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.fail_statuses = [429, 500]
    mock_upstream.mock.behaviour.retry_after = "3"
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = claude_client(gw)
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
    assert limited.value.response.headers["retry-after"] == "3"
    assert limited.value.body["error"]["message"] == "mock failure 429"  # type: ignore[index]
    with pytest.raises(anthropic.InternalServerError) as failed:
        client.messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
    assert failed.value.status_code == 502
    assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_streamed_request_is_recorded_with_ttft_and_cache_reads(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 0.05
    gw = make_gateway([anthropic_route(mock_upstream)], tenant_keys=KEYS)
    with claude_client(gw, "key-a").messages.stream(
        model="claude-x", max_tokens=8, messages=MESSAGES
    ) as stream:
        assert "".join(stream.text_stream) == "Hello from Claude"
    deadline = time.monotonic() + 5
    while True:
        report = httpx.get(
            gw.url + "/v1/metrics/ttft", headers={"authorization": "Bearer key-a"}, timeout=10
        ).json()
        routes = report.get("routes", [])
        if routes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert report["tenant"] == "acme"
    (route,) = routes
    assert route["route"] == "claude" and route["count"] == 1
    assert 45 <= route["ttft_ms"]["p50"] <= 5000
    assert route["prompt_tokens"] == 125 and route["cached_prompt_tokens"] == 100


def test_prefix_break_diagnostics_on_the_messages_shape(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    client = claude_client(gw)
    turns = [
        {"role": "user", "content": "Weather in Paris today?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    # The first turn is shared once a second request of the conversation repeats it.
    client.messages.create(model="claude-x", max_tokens=8, system=LONG_SYSTEM, messages=turns[:1])
    client.messages.create(model="claude-x", max_tokens=8, system=LONG_SYSTEM, messages=turns)
    edited = [{"role": "user", "content": "Weather in Lyon today?"}, *turns[1:]]
    changed = client.messages.with_raw_response.create(
        model="claude-x", max_tokens=8, system=LONG_SYSTEM, messages=edited
    )
    # The system prompt is block messages[0]; the first turn is messages[1].
    assert changed.headers["x-firsttoken-prefix-break"].startswith("messages[1]@char")
    assert changed.headers["x-firsttoken-policies"] == "slim,canonicalize,cache_hints"
