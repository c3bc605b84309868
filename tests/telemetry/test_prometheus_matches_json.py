"""`/metrics` and the JSON endpoint tell an operator the same TTFT: `histogram_quantile` over
the exposition lands within 5% of the JSON p50/p90/p99, for TTFTs from 1 ms (a local upstream)
to 20 s.

Events go through the real path (`Telemetry.record`: Prometheus on the spot, the store through
the batch writer), and the JSON figures come from `Telemetry.report`, what the endpoint serves.
"""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.prometheus import DEFAULT_MAX_MODELS, OTHER
from tests.telemetry.prometheus_quantile import histogram_quantile, samples, summed_buckets
from tests.telemetry.telemetry_events import make_telemetry

TOLERANCE = 0.05
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
MODELS = ("gpt-a", "gpt-b", "gpt-c")


def _event(tenant: str, ttft_s: float, model: str, route: str = "openai") -> RequestEvent:
    return RequestEvent(tenant, route, model, True, "ok", ttft_s, ttft_s * 0.9, ttft_s + 1.0)


def _scenarios() -> dict[str, list[float]]:
    """TTFT samples per tenant: single values (the hardest case: every sample in one bucket)
    across 1 ms .. 20 s, and spreads of several shapes."""
    rng = random.Random(7)
    scenarios = {
        f"const-{i}": [0.001 * 20000 ** (i / 30)] * 40 for i in range(31)
    }  # 1 ms, 1.4 ms, ... 20 s
    scenarios["loguniform"] = [
        math.exp(rng.uniform(math.log(0.02), math.log(20))) for _ in range(3000)
    ]
    scenarios["lognormal-50ms"] = [rng.lognormvariate(math.log(0.05), 0.3) for _ in range(2000)]
    scenarios["lognormal-2s"] = [rng.lognormvariate(math.log(2.0), 0.8) for _ in range(2000)]
    scenarios["two-modes"] = [rng.choice((0.04, 0.9)) * rng.uniform(0.98, 1.02) for _ in range(999)]
    scenarios["few"] = [0.031, 0.2, 5.5]
    scenarios["local-1-3ms"] = [rng.uniform(0.001, 0.003) for _ in range(500)]
    return {name: [min(20.0, max(0.001, v)) for v in values] for name, values in scenarios.items()}


async def _recorded(telemetry: Telemetry, samples: dict[str, list[float]]) -> None:
    for tenant, values in samples.items():
        for i, value in enumerate(values):
            telemetry.record(_event(tenant, value, MODELS[i % len(MODELS)]))
    await telemetry.writer.drain()


def _exposition(telemetry: Telemetry) -> str:
    body, _ = telemetry.prometheus_exposition()
    return body.decode()


async def test_histogram_quantile_matches_the_json_figures() -> None:
    telemetry = make_telemetry(telemetry_buffer=100_000)
    scenarios = _scenarios()
    await _recorded(telemetry, scenarios)
    parsed = samples(_exposition(telemetry))
    report = await telemetry.report("*")
    assert len(report["tenants"]) == len(scenarios)
    worst = 0.0
    for tenant_report in report["tenants"]:
        (route,) = tenant_report["routes"]
        buckets = summed_buckets(
            parsed, "firsttoken_ttft_seconds", tenant=tenant_report["tenant"], route="openai"
        )
        assert buckets[math.inf] == route["count"] == len(scenarios[tenant_report["tenant"]])
        for name, q in QUANTILES.items():
            json_ms = route["ttft_ms"][name]
            prom_ms = histogram_quantile(q, buckets) * 1000
            error = abs(prom_ms / json_ms - 1)
            worst = max(worst, error)
            assert error <= TOLERANCE, (tenant_report["tenant"], name, prom_ms, json_ms)
    assert 0 < worst < 0.025  # two computations, and they agree as closely as the buckets allow


async def test_redis_store_gives_the_same_agreement(redis_url: str, key_prefix: str) -> None:
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    try:
        await _recorded(telemetry, {"acme": _scenarios()["loguniform"][:500]})
        route = (await telemetry.report("acme"))["routes"][0]
        buckets = summed_buckets(
            samples(_exposition(telemetry)), "firsttoken_ttft_seconds", tenant="acme"
        )
        for name, q in QUANTILES.items():
            prom_ms = histogram_quantile(q, buckets) * 1000
            assert prom_ms == pytest.approx(route["ttft_ms"][name], rel=TOLERANCE)
    finally:
        await telemetry.aclose()


def test_no_created_series_and_every_family_parses() -> None:
    telemetry = make_telemetry()
    telemetry.record(_event("acme", 0.05, "gpt-a"))
    telemetry.record(RequestEvent("acme", "openai", "gpt-a", False, "ok", None, 0.2, 0.4))
    telemetry.record(RequestEvent("acme", "openai", "gpt-a", True, "timeout", None, None, 9.0))
    telemetry.metrics.observe_passthrough("acme", "files", 200, 0.01)
    exposition = _exposition(telemetry)
    assert "_created" not in exposition
    names = {s.name for f in text_string_to_metric_families(exposition) for s in f.samples}
    assert "firsttoken_complete_seconds_count" in names
    assert "firsttoken_passthrough_seconds_count" in names
    assert "firsttoken_errors_total" in names


def test_model_label_is_bounded_per_tenant() -> None:
    telemetry = make_telemetry()
    for i in range(DEFAULT_MAX_MODELS + 3):
        telemetry.record(_event("acme", 0.1, f"gpt-{i}"))
    telemetry.record(_event("globex", 0.1, "gpt-late"))  # acme's made-up names cost it nothing
    seen: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(_exposition(telemetry)):
        for s in family.samples:
            if s.name == "firsttoken_ttft_seconds_count":
                seen.setdefault(s.labels["tenant"], {})[s.labels["model"]] = s.value
    assert set(seen["acme"]) == {*(f"gpt-{i}" for i in range(DEFAULT_MAX_MODELS)), OTHER}
    assert seen["acme"][OTHER] == 3
    assert seen["globex"] == {"gpt-late": 1}


def test_hostile_label_values_keep_the_exposition_valid() -> None:
    telemetry = make_telemetry()
    nasty = 'a"b\\c\nd\ud800' + "x" * 500
    telemetry.record(_event(nasty, 0.1, nasty, route=nasty))
    telemetry.record_prefix_break(nasty, nasty)
    labels = [
        s.labels
        for f in text_string_to_metric_families(_exposition(telemetry))
        for s in f.samples
        if s.name == "firsttoken_ttft_seconds_count"
    ]
    assert len(labels) == 1
    assert labels[0]["tenant"].startswith('a"b\\c\nd')
    assert len(labels[0]["model"]) <= 200
