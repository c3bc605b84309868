"""The OpenAI SDK through the gateway against a real OpenAI-compatible server on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.harness import free_port
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route


def test_non_streaming_chat_passes_unknown_fields_and_swaps_key(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    resp = sdk_client(gw).chat.completions.create(
        model="mock-1",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"x_vendor_option": {"a": 1}},
    )
    assert resp.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 "
    assert resp.model_extra["x_unknown_field"] == {"kept": True}
    seen = mock_upstream.mock.requests[-1]
    assert seen["body"]["x_vendor_option"] == {"a": 1}
    assert seen["headers"]["Authorization"] == "Bearer sk-upstream-secret"
    assert "client-key" not in str(seen["headers"])


def test_streaming_chat_hides_usage_the_client_did_not_ask_for(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    chunks = list(
        sdk_client(gw).chat.completions.create(
            model="mock-1", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    assert all(c.choices for c in chunks), "usage-only chunk leaked to a client that did not ask"
    assert mock_upstream.mock.requests[-1]["body"]["stream_options"] == {"include_usage": True}


def test_streaming_chat_keeps_usage_when_asked(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    chunks = list(
        sdk_client(gw).chat.completions.create(
            model="mock-1",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_tool_calls_stream_and_not(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.tool_call = True
    gw = make_gateway([openai_route(mock_upstream)])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    c = sdk_client(gw)
    resp = c.chat.completions.create(
        model="mock-1", tools=tools, messages=[{"role": "user", "content": "weather?"}]
    )
    assert resp.choices[0].message.tool_calls[0].function.arguments == '{"city":"Paris"}'
    args = ""
    for chunk in c.chat.completions.create(
        model="mock-1", tools=tools, stream=True, messages=[{"role": "user", "content": "weather?"}]
    ):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args += call.function.arguments or ""
    assert args == '{"city":"Paris"}'


def test_legacy_completions(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    c = sdk_client(gw)
    assert c.completions.create(model="mock-1", prompt="say").choices[0].text == "hello world"
    text = "".join(
        ch.choices[0].text for ch in c.completions.create(model="mock-1", prompt="say", stream=True)
    )
    assert text == "hello world"


def test_models_lists_exact_names_and_what_the_patterns_match(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream, models=["gpt-4o", "mock-*"])])
    ids = [m.id for m in sdk_client(gw).models.list()]
    assert ids == ["gpt-4o", "mock-model"]
    gw2 = make_gateway([openai_route(mock_upstream, models=["gpt-*"])])
    assert [m.id for m in sdk_client(gw2).models.list()] == []


def test_other_v1_paths_pass_through(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)])
    emb = sdk_client(gw).embeddings.create(model="mock-embed", input="hello")
    assert emb.data[0].embedding == [0.1, 0.2, 0.3]
    seen = mock_upstream.mock.requests[-1]
    assert seen["path"] == "/v1/embeddings"
    assert seen["headers"]["Authorization"] == "Bearer sk-upstream-secret"


def test_retry_before_first_byte_on_5xx_and_429(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.fail_statuses = [500, 429]
    mock_upstream.mock.behaviour.retry_after = "0"
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=3)
    chunks = list(
        sdk_client(gw).chat.completions.create(
            model="mock-1", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("tok0")
    assert len(mock_upstream.mock.requests) == 3


def test_fallback_route_serves_when_primary_is_down(mock_upstream, make_gateway):
    dead = {
        "name": "dead",
        "models": ["mock-*"],
        "kind": "openai",
        "base_url": f"http://127.0.0.1:{free_port()}/v1",
        "fallbacks": ["mock"],
    }
    backup = openai_route(mock_upstream, models=["backup-only"])
    gw = make_gateway([dead, backup])
    resp = sdk_client(gw).chat.completions.create(
        model="mock-1", messages=[{"role": "user", "content": "hi"}]
    )
    assert resp.choices[0].message.content.startswith("tok0")


def test_no_retry_after_first_byte_error_reported_in_stream(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.die_after_chunks = 2
    mock_upstream.mock.behaviour.gap_s = 0.05  # tok0 and tok1 reach the client before the cut
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=3)
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        timeout=20,
        json={"model": "mock-1", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        body = r.read().decode()
    assert r.status_code == 200
    assert "tok1" in body and '"error"' in body
    assert len(mock_upstream.mock.requests) == 1


def test_stream_cut_before_any_event_is_retried(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.cut_before_events = True
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=2)
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        timeout=20,
        json={"model": "mock-1", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        body = r.read().decode()
    assert '"error"' in body and body.rstrip().endswith("}\n\ndata: [DONE]")
    assert len(mock_upstream.mock.requests) == 2


def test_keepalive_comments_while_waiting_for_first_token(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 0.6
    gw = make_gateway([openai_route(mock_upstream)], keepalive_s=0.1)
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        timeout=20,
        json={"model": "mock-1", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        body = r.read().decode()
    head = body[: body.index("data:")]
    assert head.count(": keepalive") >= 3
    assert r.headers["x-accel-buffering"] == "no" and "no-transform" in r.headers["cache-control"]
    assert "content-encoding" not in r.headers


def test_first_token_timeout_is_504_and_falls_back(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 1.0
    gw = make_gateway([openai_route(mock_upstream, first_token_timeout_s=0.2)], retry_attempts=1)
    with pytest.raises(openai.APIStatusError) as err:
        sdk_client(gw).chat.completions.create(
            model="mock-1", stream=True, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.status_code == 504
