import itertools
import time

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.histogram import GROWTH
from gateway.telemetry.prometheus import TTFT_BUCKETS_S
from tests.telemetry.telemetry_events import make_telemetry


def _samples(telemetry: Telemetry) -> dict[tuple, float]:
    body, content_type = telemetry.prometheus_exposition()
    assert content_type.startswith("text/plain")
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _key(name: str, **labels: str) -> tuple:
    return name, tuple(sorted(labels.items()))


def _le(value_s: float) -> str:
    """The `le` label of the TTFT bucket that holds `value_s`."""
    return floatToGoString(min(b for b in TTFT_BUCKETS_S if b >= value_s))


def _event(tenant: str, status: str = "ok", ttft_s: float | None = 0.3, **extra) -> RequestEvent:
    return RequestEvent(
        tenant, "openai", "m", ttft_s is not None, status, ttft_s, 0.25, 1.0, **extra
    )


def test_histograms_counters_and_labels() -> None:
    telemetry = make_telemetry()
    telemetry.record(
        _event(
            "acme",
            output_tokens=7,
            prompt_tokens=100,
            cached_prompt_tokens=60,
            prompt_tokens_saved=5,
            fallback=True,
        )
    )
    telemetry.record(_event("acme", ttft_s=1.7))
    telemetry.record(_event("acme", status="upstream_error", ttft_s=None))
    telemetry.record_prefix_break("acme", "system_changed")
    s = _samples(telemetry)
    labels = {"route": "openai", "tenant": "acme", "model": "m", "api": "chat"}
    assert s[_key("firsttoken_ttft_seconds_count", **labels)] == 2
    assert s[_key("firsttoken_ttft_seconds_bucket", le=_le(0.3), **labels)] == 1
    assert s[_key("firsttoken_ttft_seconds_bucket", le=_le(0.29), **labels)] == 0
    assert s[_key("firsttoken_ttft_seconds_bucket", le=_le(1.7), **labels)] == 2
    assert s[_key("firsttoken_ttft_seconds_bucket", le="+Inf", **labels)] == 2
    assert s[_key("firsttoken_ttft_seconds_sum", **labels)] == 2.0
    assert s[_key("firsttoken_upstream_ttft_seconds_count", **labels)] == 3
    assert s[_key("firsttoken_gateway_seconds_count", **labels)] == 2
    assert s[_key("firsttoken_requests_total", status="ok", **labels)] == 2
    assert s[_key("firsttoken_requests_total", status="upstream_error", **labels)] == 1
    assert s[_key("firsttoken_errors_total", status="upstream_error", **labels)] == 1
    assert _key("firsttoken_errors_total", status="ok", **labels) not in s
    assert s[_key("firsttoken_output_tokens_total", **labels)] == 7
    assert s[_key("firsttoken_cached_prompt_tokens_total", **labels)] == 60
    assert s[_key("firsttoken_prompt_tokens_saved_total", **labels)] == 5
    assert s[_key("firsttoken_fallbacks_total", **labels)] == 1
    assert s[_key("firsttoken_prefix_breaks_total", kind="system_changed", tenant="acme")] == 1
    assert _key("firsttoken_complete_seconds_count", **labels) not in s  # never observed
    assert s[_key("firsttoken_telemetry_dropped_total")] == 0


def test_buckets_follow_the_store_histogram_where_ttft_lives() -> None:
    inside = [b for b in TTFT_BUCKETS_S if 0.00098 <= b <= 31.0]
    assert inside[0] <= 0.001 and inside[-1] >= 30.0  # from a local upstream's 1 ms
    steps = [hi / lo for lo, hi in itertools.pairwise(inside)]
    assert max(steps) < GROWTH * 1.001 and min(steps) > GROWTH * 0.999
    assert len(TTFT_BUCKETS_S) + 3 <= 274  # the cost the module docstring states


def test_tenant_labels_are_bounded() -> None:
    telemetry = make_telemetry(metrics_max_tenants=3)
    for i in range(10):
        telemetry.record(_event(f"t{i}"))
    s = _samples(telemetry)
    tenants = {dict(k[1]).get("tenant") for k in s if k[0] == "firsttoken_ttft_seconds_count"}
    assert tenants == {"t0", "t1", "t2", "other"}
    assert (
        s[
            _key(
                "firsttoken_ttft_seconds_count",
                route="openai",
                tenant="other",
                model="m",
                api="chat",
            )
        ]
        == 7
    )


def test_registries_are_private() -> None:
    first, second = make_telemetry(), make_telemetry()
    first.record(_event("acme"))
    assert _key(
        "firsttoken_ttft_seconds_count", route="openai", tenant="acme", model="m", api="chat"
    ) in (_samples(first))
    assert _key(
        "firsttoken_ttft_seconds_count", route="openai", tenant="acme", model="m", api="chat"
    ) not in (_samples(second))
    assert REGISTRY.get_sample_value("firsttoken_telemetry_dropped_total") is None


def test_dropped_counter_counts_buffer_overflow_exactly() -> None:
    telemetry = make_telemetry(telemetry_buffer=5)  # never started: nothing drains
    for _ in range(12):
        telemetry.record(_event("acme"))
    assert telemetry.dropped == 7
    assert _samples(telemetry)[("firsttoken_telemetry_dropped_total", ())] == 7
    assert _samples(telemetry)[("firsttoken_telemetry_buffered", ())] == 5


def test_record_is_cheap_and_disabled_records_nothing() -> None:
    telemetry = make_telemetry(telemetry_buffer=100_000)
    events = [_event(f"t{i % 20}", output_tokens=10, prompt_tokens=100) for i in range(20_000)]
    began = time.perf_counter()
    for event in events:
        telemetry.record(event)
    per_call = (time.perf_counter() - began) / len(events)
    assert per_call < 100e-6, per_call
    off = make_telemetry(telemetry=False)
    off.record(_event("acme"))
    assert off.writer.buffered == 0
    assert _key(
        "firsttoken_ttft_seconds_count", route="openai", tenant="acme", model="m", api="chat"
    ) not in (_samples(off))
    assert not any(name.startswith("firsttoken_requests") for name, _ in _samples(off))


def test_record_never_raises_on_malformed_events() -> None:
    telemetry = make_telemetry()
    telemetry.record(RequestEvent("acme", "r", "m", True, "weird", "not-a-number", None, 1.0))  # type: ignore[arg-type]
    telemetry.record(None)  # type: ignore[arg-type]
    telemetry.record_prefix_break(None, None)  # type: ignore[arg-type]
    assert (
        _samples(telemetry)[
            _key(
                "firsttoken_requests_total",
                route="r",
                status="other",
                tenant="acme",
                model="m",
                api="chat",
            )
        ]
        == 1
    )
