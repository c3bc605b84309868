"""Cached tokens reported in a provider's own usage field reach the client in OpenAI's field
(the provider's kept beside it) and are counted per route by /v1/metrics/ttft and Prometheus:
DeepSeek and Moonshot mocks at their wire format, through the OpenAI SDK."""

from __future__ import annotations

import httpx
import pytest

from bench.mock_openai import ThreadedServer
from tests.ops.test_metrics_through_gateway import metrics_text, wait_for_count
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route
from tests.support.usage_mocks import ProviderChatMock
from tests.telemetry.prometheus_quantile import samples

KEYS = "acme:key-a"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["deepseek", "moonshot", "moonshot_top"])
def provider(request):
    mock = ProviderChatMock(request.param)
    with ThreadedServer(mock) as server:  # type: ignore[arg-type]
        yield request.param, mock, server


def gateway_for(make_gateway, server, name: str):
    route = openai_route(server, name=name, models=["chat-*"])
    return make_gateway([route], tenant_keys=KEYS, admin_keys="root-key")


def prometheus_cached(gw, route: str) -> float:
    return sum(
        s.value
        for s in samples(metrics_text(gw))
        if s.name == "firsttoken_cached_prompt_tokens_total"
        and s.labels.get("route") == route
        and s.labels.get("tenant") == "acme"
    )


def test_stream_with_include_usage_shows_and_counts_cached_tokens(provider, make_gateway):
    style, _mock, server = provider
    gw = gateway_for(make_gateway, server, style)
    client = sdk_client(gw, "key-a")
    chunks = list(
        client.chat.completions.create(
            model="chat-1",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello there"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens == 1100
    assert usage[0].prompt_tokens_details.cached_tokens == 1024
    own = usage[0].model_extra
    if style == "deepseek":
        assert own["prompt_cache_hit_tokens"] == 1024 and own["prompt_cache_miss_tokens"] == 76
    else:
        assert own["cached_tokens"] == 1024
    route = wait_for_count(gw, "key-a", 1)["routes"][0]
    assert route["route"] == style
    assert route["prompt_tokens"] == 1100 and route["cached_prompt_tokens"] == 1024
    assert prometheus_cached(gw, style) == 1024


def test_stream_without_include_usage_still_counts_them(provider, make_gateway):
    style, mock, server = provider
    gw = gateway_for(make_gateway, server, style)
    client = sdk_client(gw, "key-a")
    chunks = list(client.chat.completions.create(model="chat-1", messages=MESSAGES, stream=True))
    assert mock.requests[-1]["body"]["stream_options"] == {"include_usage": True}
    if style == "deepseek":  # the usage-only chunk the client did not ask for is dropped
        assert all(c.choices for c in chunks)
    route = wait_for_count(gw, "key-a", 1)["routes"][0]
    assert route["cached_prompt_tokens"] == 1024


@pytest.mark.parametrize("style", ["deepseek", "moonshot"])
def test_non_stream_shows_and_counts_cached_tokens(style, make_gateway):
    with ThreadedServer(ProviderChatMock(style)) as server:  # type: ignore[arg-type]
        non_stream_checks(make_gateway, server, style)


def non_stream_checks(make_gateway, server, style: str) -> None:
    gw = gateway_for(make_gateway, server, style)
    client = sdk_client(gw, "key-a")
    completion = client.chat.completions.create(model="chat-1", messages=MESSAGES)
    assert completion.choices[0].message.content == "hello there"
    assert completion.usage.prompt_tokens_details.cached_tokens == 1024
    assert completion.usage.total_tokens == 1102
    raw = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "chat-1", "messages": MESSAGES},
        headers={"authorization": "Bearer key-a"},
    ).json()
    kept = "prompt_cache_hit_tokens" if style == "deepseek" else "cached_tokens"
    assert raw["usage"][kept] == 1024
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 1024}
    route = wait_for_count(gw, "key-a", 2)["routes"][0]
    assert route["count"] == 2 and route["stream_count"] == 0
    assert route["prompt_tokens"] == 2200 and route["cached_prompt_tokens"] == 2048
    assert prometheus_cached(gw, style) == 2048


def test_cached_count_above_the_prompt_is_clamped(make_gateway):
    mock = ProviderChatMock("deepseek", prompt_tokens=100, cached_tokens=5000)
    with ThreadedServer(mock) as server:  # type: ignore[arg-type]
        gw = gateway_for(make_gateway, server, "deepseek")
        completion = sdk_client(gw, "key-a").chat.completions.create(
            model="chat-1", messages=MESSAGES
        )
    assert completion.usage.prompt_tokens_details.cached_tokens == 100


def test_messages_door_over_a_deepseek_route_reads_the_cache_hit(make_gateway):
    mock = ProviderChatMock("deepseek")
    with ThreadedServer(mock) as server:  # type: ignore[arg-type]
        gw = gateway_for(make_gateway, server, "deepseek")
        headers = {"x-api-key": "key-a", "anthropic-version": "2023-06-01"}
        body = {"model": "chat-1", "max_tokens": 16, "messages": MESSAGES}
        whole = httpx.post(gw.url + "/v1/messages", json=body, headers=headers).json()
        streamed = httpx.post(
            gw.url + "/v1/messages", json={**body, "stream": True}, headers=headers
        ).text
    assert whole["usage"]["cache_read_input_tokens"] == 1024
    assert whole["usage"]["input_tokens"] == 76
    assert '"cache_read_input_tokens":1024' in streamed
