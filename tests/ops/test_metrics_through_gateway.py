"""TTFT recorded by the gateway, read back per tenant, from Prometheus, and merged across
gateways sharing one Redis."""

from __future__ import annotations

import time

import httpx

from gateway.telemetry.prometheus import DEFAULT_MAX_MODELS, OTHER
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route
from tests.telemetry.prometheus_quantile import histogram_quantile, samples, summed_buckets

KEYS = "acme:key-a,globex:key-b"


def stream_once(gw, key: str, model: str = "mock-1") -> None:
    c = sdk_client(gw, key)
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


def metrics_text(gw, key: str = "root-key") -> str:
    response = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200
    return response.text


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


def test_two_gateways_share_one_redis(redis_url, key_prefix, mock_upstream, make_gateway):
    common = dict(redis_url=redis_url, metrics_key_prefix=key_prefix, tenant_keys=KEYS)
    one = make_gateway([openai_route(mock_upstream)], **common)
    two = make_gateway([openai_route(mock_upstream)], **common)
    for _ in range(2):
        stream_once(one, "key-a")
    for _ in range(3):
        stream_once(two, "key-a")
    merged = wait_for_count(one, "key-a", 5)
    assert merged["routes"][0]["count"] == 5
    assert wait_for_count(two, "key-a", 5)["routes"][0]["count"] == 5


def test_prometheus_quantiles_match_the_json_endpoint(mock_upstream, make_gateway):
    """What an operator's `histogram_quantile(q, sum by (le) (...))` reads from /metrics is
    within 5% of the JSON figures, for real requests with known TTFTs."""
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key")
    delays = (0.02, 0.05, 0.12, 0.3)
    for i, delay in enumerate(delays * 3):
        mock_upstream.mock.behaviour.first_delay_s = delay
        stream_once(gw, "key-a", model=("mock-1", "mock-2")[i % 2])
    route = wait_for_count(gw, "key-a", len(delays) * 3)["routes"][0]
    parsed = samples(metrics_text(gw))
    buckets = summed_buckets(parsed, "firsttoken_ttft_seconds", tenant="acme", route="mock")
    assert buckets[float("inf")] == route["count"] == 12
    for name, q in {"p50": 0.5, "p90": 0.9, "p99": 0.99}.items():
        prom_ms = histogram_quantile(q, buckets) * 1000
        assert abs(prom_ms / route["ttft_ms"][name] - 1) <= 0.05, (name, prom_ms, route)
    models = {s.labels["model"] for s in parsed if s.name == "firsttoken_ttft_seconds_count"}
    assert models == {"mock-1", "mock-2"}
    assert not [s.name for s in parsed if s.name.endswith("_created")]


def test_model_label_folds_past_its_cap(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key")
    for i in range(DEFAULT_MAX_MODELS + 1):
        stream_once(gw, "key-a", model=f"gpt-{i}")
    wait_for_count(gw, "key-a", DEFAULT_MAX_MODELS + 1)
    counts = {
        s.labels["model"]: s.value
        for s in samples(metrics_text(gw))
        if s.name == "firsttoken_requests_total" and s.labels["tenant"] == "acme"
    }
    assert len(counts) == DEFAULT_MAX_MODELS + 1
    assert counts[OTHER] == 1 and "gpt-0" in counts
