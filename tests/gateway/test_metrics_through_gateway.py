"""TTFT recorded by the gateway, read back per tenant, from Prometheus, and merged across
gateways sharing one Redis."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
import redis

from tests.gateway.conftest import openai_route

REDIS_URL = "redis://127.0.0.1:6379/14"
KEYS = "acme:key-a,globex:key-b"


def stream_once(gw, key: str, model: str = "mock-1") -> None:
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)
    list(
        c.chat.completions.create(
            model=model, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
    )


def ttft_report(gw, key: str, **params) -> httpx.Response:
    return httpx.get(
        gw.url + "/v1/metrics/ttft",
        params=params,
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def wait_for_count(gw, key: str, count: int, **params) -> dict:
    deadline = time.monotonic() + 5
    while True:
        body = ttft_report(gw, key, **params).json()
        routes = body.get("routes", [])
        if (routes and sum(r["count"] for r in routes) >= count) or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_tenant_reads_its_own_ttft_with_cache_and_slo(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 0.05
    mock_upstream.mock.behaviour.cached_tokens = 4
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, ttft_slo_ms=2000)
    for _ in range(3):
        stream_once(gw, "key-a")
    body = wait_for_count(gw, "key-a", 3)
    assert body["tenant"] == "acme"
    route = body["routes"][0]
    assert route["route"] == "mock" and route["count"] == 3
    assert 45 <= route["ttft_ms"]["p50"] <= 1000
    assert route["upstream_ttft_ms"]["p50"] <= route["ttft_ms"]["p50"] * 1.05
    assert route["gateway_ms"]["p50"] >= 0
    assert route["prompt_tokens"] == 30 and route["cached_prompt_tokens"] == 12
    assert route["slo"]["target_ms"] == 2000 and route["slo"]["attainment"] == 1.0


def test_tenant_cannot_read_another_tenant(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key")
    stream_once(gw, "key-b")
    assert ttft_report(gw, "key-a", tenant="globex").status_code == 403
    assert ttft_report(gw, "key-a", tenant="*").status_code == 403
    assert ttft_report(gw, "nope").status_code == 401
    mine = wait_for_count(gw, "key-a", 0)
    assert mine["tenant"] == "acme" and mine["routes"] == []
    theirs = wait_for_count(gw, "root-key", 1, tenant="globex")
    assert theirs["tenant"] == "globex" and theirs["routes"][0]["count"] == 1
    everyone = ttft_report(gw, "root-key", tenant="*").json()
    assert "globex" in [t["tenant"] for t in everyone["tenants"]]


def test_prometheus_exposition_is_admin_only_when_keyed(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key")
    stream_once(gw, "key-a")
    assert httpx.get(gw.url + "/metrics").status_code == 401
    text = httpx.get(gw.url + "/metrics", headers={"authorization": "Bearer root-key"}).text
    assert "firsttoken_ttft_seconds_bucket{" in text and 'tenant="acme"' in text
    assert "firsttoken_telemetry_dropped_total" in text


@pytest.fixture
def shared_redis():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = "ftgw-" + uuid.uuid4().hex[:10]
    yield prefix
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def test_two_gateways_share_one_redis(mock_upstream, make_gateway, shared_redis):
    common = dict(redis_url=REDIS_URL, metrics_key_prefix=shared_redis, tenant_keys=KEYS)
    one = make_gateway([openai_route(mock_upstream)], **common)
    two = make_gateway([openai_route(mock_upstream)], **common)
    for _ in range(2):
        stream_once(one, "key-a")
    for _ in range(3):
        stream_once(two, "key-a")
    merged = wait_for_count(one, "key-a", 5)
    assert merged["routes"][0]["count"] == 5
    assert wait_for_count(two, "key-a", 5)["routes"][0]["count"] == 5
