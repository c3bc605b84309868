"""Reports from the memory store and from Redis, checked against figures from the raw events."""

import time

import numpy as np
import pytest

from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.store import MemoryStore
from tests.telemetry.telemetry_events import aggregate_events, make_events, make_telemetry


async def _recorded(telemetry: Telemetry, events) -> Telemetry:
    await telemetry.start()
    for event in events:
        telemetry.record(event)
    await telemetry.writer.drain()
    return telemetry


def _route(report: dict, name: str) -> dict:
    (route,) = [r for r in report["routes"] if r["route"] == name]
    return route


async def test_memory_and_redis_stores_give_the_same_report(
    redis_url: str, key_prefix: str
) -> None:
    events = make_events(seed=1, count=3000)
    memory = await _recorded(make_telemetry(ttft_slo_tenants={"acme": 400.0}), events)
    shared = await _recorded(
        make_telemetry(redis_url, metrics_key_prefix=key_prefix, ttft_slo_tenants={"acme": 400.0}),
        events,
    )
    try:
        from_memory = await memory.report("acme")
        from_redis = await shared.report("acme")
        assert from_memory == from_redis
        assert sum(r["count"] for r in from_redis["routes"]) == 3000
        assert await memory.report("*") == await shared.report("*")
        assert await shared.known_tenants() == ["acme"]
    finally:
        await memory.aclose()
        await shared.aclose()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_report_figures_match_the_raw_events(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("key_prefix")
        telemetry = make_telemetry(url, metrics_key_prefix=prefix, ttft_slo_ms=350.0)
    else:
        telemetry = make_telemetry(ttft_slo_ms=350.0)
    events = make_events(seed=2, count=4000)
    await _recorded(telemetry, events)
    try:
        report = await telemetry.report("acme", window_s=3600)
        assert report["tenant"] == "acme" and report["window_s"] == 3600
        for route_name in ("openai", "local"):
            mine = [e for e in events if e.route == route_name]
            streams = [e for e in mine if e.stream]
            route = _route(report, route_name)
            assert route["count"] == len(mine)
            assert route["stream_count"] == len(streams)
            ttft = np.array([e.ttft_s for e in streams]) * 1000
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                exact = float(np.quantile(ttft, q))
                assert abs(route["ttft_ms"][name] - exact) / exact < 0.05
            assert route["ttft_ms"]["mean"] == pytest.approx(ttft.mean(), abs=1e-3)
            upstream = np.array([e.upstream_ttft_s for e in mine]) * 1000
            assert (
                abs(route["upstream_ttft_ms"]["p50"] - np.median(upstream)) / np.median(upstream)
                < 0.05
            )
            gateway = np.array([e.ttft_s - e.upstream_ttft_s for e in streams]) * 1000
            assert abs(route["gateway_ms"]["p50"] - np.median(gateway)) / np.median(gateway) < 0.05
            complete = (
                np.array([e.total_s for e in mine if not e.stream and e.status == "ok"]) * 1000
            )
            assert (
                abs(route["complete_ms"]["p50"] - np.median(complete)) / np.median(complete) < 0.05
            )
            prompt = sum(e.prompt_tokens for e in mine)
            cached = sum(e.cached_prompt_tokens for e in mine)
            assert (route["prompt_tokens"], route["cached_prompt_tokens"]) == (prompt, cached)
            assert route["cache_hit_ratio"] == pytest.approx(cached / prompt, abs=1e-6)
            assert route["prompt_tokens_saved"] == sum(e.prompt_tokens_saved for e in mine)
            assert route["output_tokens"] == sum(e.output_tokens for e in mine)
            assert route["errors"] == sum(e.status != "ok" for e in mine)
            assert route["fallbacks"] == sum(e.fallback for e in mine)
            attained = float(np.mean(ttft <= 350.0))
            assert route["slo"]["target_ms"] == 350.0
            assert route["slo"]["attainment"] == pytest.approx(attained, abs=0.01)
            budget = 1 - (1 - route["slo"]["attainment"]) / (1 - 0.99)
            assert route["slo"]["budget_remaining"] == pytest.approx(budget, abs=1e-3)
    finally:
        await telemetry.aclose()


async def test_window_excludes_older_minutes_and_other_tenants() -> None:
    telemetry = make_telemetry()
    now = time.time()
    base = dict(route="r", model="m", stream=True, status="ok", upstream_ttft_s=0.1, total_s=1.0)
    telemetry.record(RequestEvent(tenant="a", ttft_s=0.2, ts=now - 10, **base))
    telemetry.record(RequestEvent(tenant="a", ttft_s=0.9, ts=now - 7200, **base))
    telemetry.record(RequestEvent(tenant="b", ttft_s=0.5, ts=now - 10, **base))
    await telemetry.writer.drain()
    recent = await telemetry.report("a", window_s=600)
    assert [r["count"] for r in recent["routes"]] == [1]
    assert recent["routes"][0]["ttft_ms"]["p50"] == pytest.approx(200, rel=0.02)
    assert [r["count"] for r in (await telemetry.report("a", window_s=3 * 3600))["routes"]] == [2]
    assert (await telemetry.report("nobody"))["routes"] == []
    everyone = await telemetry.report("*", window_s=600)
    assert [t["tenant"] for t in everyone["tenants"]] == ["a", "b"]
    await telemetry.aclose()


async def test_non_stream_time_never_enters_ttft() -> None:
    telemetry = make_telemetry()
    telemetry.record(
        RequestEvent(
            "a", "r", "m", stream=False, status="ok", ttft_s=None, upstream_ttft_s=None, total_s=4.0
        )
    )
    await telemetry.writer.drain()
    (route,) = (await telemetry.report("a"))["routes"]
    assert route["ttft_ms"]["p50"] is None and route["slo"]["attainment"] is None
    assert route["complete_ms"]["p50"] == pytest.approx(4000, rel=0.02)
    await telemetry.aclose()


async def test_budget_goes_negative_when_misses_exceed_it() -> None:
    telemetry = make_telemetry(ttft_slo_ms=100.0, ttft_slo_objective=0.9)
    for i in range(10):  # 8 fast, 2 slow: attainment 0.8 against a 0.9 objective
        telemetry.record(
            RequestEvent(
                "a",
                "r",
                "m",
                True,
                "ok",
                ttft_s=0.05 if i < 8 else 0.5,
                upstream_ttft_s=None,
                total_s=1.0,
            )
        )
    await telemetry.writer.drain()
    slo = (await telemetry.report("a"))["routes"][0]["slo"]
    assert slo["attainment"] == pytest.approx(0.8)
    assert slo["budget_remaining"] == pytest.approx(-1.0)
    await telemetry.aclose()


def test_memory_store_prunes_after_retention() -> None:
    import asyncio

    store = MemoryStore(retention_s=120)
    old = RequestEvent("a", "r", "m", True, "ok", 0.1, 0.1, 1.0, ts=time.time() - 3600)
    asyncio.run(store.write(aggregate_events([old]), {}))
    store._prune(time.time())
    assert asyncio.run(store.tenants()) == []


async def test_redis_buckets_expire_after_retention(
    redis_url: str, key_prefix: str, sync_redis
) -> None:
    from gateway.telemetry.keys import KeySpace

    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix, metrics_retention=600)
    now = time.time()
    telemetry.record(RequestEvent("a", "r", "m", True, "ok", 0.2, 0.1, 1.0, ts=now))
    await telemetry.writer.drain()
    keys = KeySpace(key_prefix)
    expected_ttl = (int(now // 60) + 1) * 60 + 600 - now
    assert abs(sync_redis.ttl(keys.bucket("a", "r", int(now // 60))) - expected_ttl) <= 2
    assert 600 < sync_redis.ttl(keys.routes("a")) <= 720
    assert 600 < sync_redis.ttl(keys.tenants()) <= 720
    await telemetry.aclose()
