"""Gateway processes sharing one Redis report the percentiles of the union of their events."""

import asyncio
import time

import numpy as np

from tests.telemetry.telemetry_events import make_events, make_telemetry, write_in_processes


def _assert_matches_union(report: dict, events) -> None:
    assert {r["route"] for r in report["routes"]} == {"openai", "local"}
    for route in report["routes"]:
        mine = [e for e in events if e.route == route["route"]]
        assert route["count"] == len(mine)
        ttft = np.array([e.ttft_s for e in mine if e.stream]) * 1000
        upstream = np.array([e.upstream_ttft_s for e in mine]) * 1000
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            exact = float(np.quantile(ttft, q))
            assert abs(route["ttft_ms"][name] - exact) / exact < 0.05, (
                name,
                route["ttft_ms"],
                exact,
            )
            exact_up = float(np.quantile(upstream, q))
            assert abs(route["upstream_ttft_ms"][name] - exact_up) / exact_up < 0.05
        assert route["prompt_tokens"] == sum(e.prompt_tokens for e in mine)


async def test_two_instances_in_one_process_merge(redis_url: str, key_prefix: str) -> None:
    first = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    # A different distribution in the second instance, so a wrong merge would show.
    second = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    a, b = make_events(seed=10, count=2000), make_events(seed=11, count=1500)
    for event in b:
        event.ttft_s = None if event.ttft_s is None else event.ttft_s * 3
    await first.start()
    await second.start()
    for x, y in zip(a, b, strict=False):
        first.record(x)
        second.record(y)
    for event in a[len(b) :]:
        first.record(event)
    await asyncio.gather(first.writer.drain(), second.writer.drain())
    report_first, report_second = await first.report("acme"), await second.report("acme")
    assert report_first == report_second
    _assert_matches_union(report_first, a + b)
    await first.aclose()
    await second.aclose()


def test_two_real_processes_merge(redis_url: str, key_prefix: str, subprocess_env: dict) -> None:
    now = time.time()
    runs = [(21, 2500), (22, 2500)]
    union = write_in_processes(redis_url, key_prefix, subprocess_env, runs, now)

    async def read() -> dict:
        reader = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
        try:
            return await reader.report("acme")
        finally:
            await reader.aclose()

    _assert_matches_union(asyncio.run(read()), union)
