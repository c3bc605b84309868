"""A private Redis dies mid-recording: record() stays fast, the bound holds, the rest arrives."""

import asyncio
import re
import statistics
import time

from gateway.telemetry import Telemetry
from tests.telemetry.telemetry_events import make_events, make_telemetry, until

BUFFER_MAX = 200


def _prometheus_dropped(telemetry: Telemetry) -> float:
    body, _ = telemetry.prometheus_exposition()
    return float(re.search(rb"^firsttoken_telemetry_dropped_total (\S+)$", body, re.M).group(1))


async def test_redis_killed_and_restarted(private_redis) -> None:
    private_redis.start()
    telemetry = make_telemetry(
        private_redis.url, telemetry_buffer=BUFFER_MAX, flush_interval_s=0.02, flush_batch=50
    )
    await telemetry.start()
    events = make_events(seed=5, count=700)
    try:
        for event in events[:100]:
            telemetry.record(event)
        assert await until(lambda: telemetry.writer.written == 100, 5)

        private_redis.kill()
        durations = []
        for start in range(
            100, 700, 25
        ):  # yield between bursts so the writer keeps failing meanwhile
            for event in events[start : start + 25]:
                began = time.perf_counter()
                telemetry.record(event)
                durations.append(time.perf_counter() - began)
            await asyncio.sleep(0.01)
        assert telemetry.writer.failures > 0
        assert max(durations) < 0.01, max(durations)
        assert statistics.median(durations) < 100e-6, statistics.median(durations)
        assert telemetry.writer.buffered == BUFFER_MAX
        assert telemetry.dropped == 600 - BUFFER_MAX
        assert _prometheus_dropped(telemetry) == 600 - BUFFER_MAX

        private_redis.start()  # a fresh, empty server on the same port
        assert await until(lambda: telemetry.writer.buffered == 0, 10)
        report = await telemetry.report("acme")
        # Exactly the buffered events: the 100 written before died with the old server.
        assert sum(r["count"] for r in report["routes"]) == BUFFER_MAX
        assert telemetry.writer.written == 100 + BUFFER_MAX
        assert telemetry.dropped == 600 - BUFFER_MAX
    finally:
        await telemetry.aclose()


async def test_shutdown_flushes_the_buffer(private_redis) -> None:
    private_redis.start()
    telemetry = make_telemetry(private_redis.url, flush_interval_s=60, flush_batch=10_000)
    await telemetry.start()
    for event in make_events(seed=6, count=300):
        telemetry.record(event)
    await telemetry.aclose()
    assert telemetry.writer.written == 300 and telemetry.dropped == 0
    reader = make_telemetry(private_redis.url)
    assert sum(r["count"] for r in (await reader.report("acme"))["routes"]) == 300
    await reader.aclose()


async def test_shutdown_with_redis_down_is_bounded_and_counts_the_loss(private_redis) -> None:
    private_redis.start()
    telemetry = make_telemetry(private_redis.url, flush_interval_s=0.02)
    await telemetry.start()
    private_redis.kill()
    for event in make_events(seed=7, count=50):
        telemetry.record(event)
    began = time.monotonic()
    await telemetry.aclose(timeout_s=2.0)
    assert time.monotonic() - began < 3.0
    assert telemetry.dropped == 50 and telemetry.writer.buffered == 0


async def test_fingerprints_unreachable_redis_returns_none_fast(private_redis) -> None:
    private_redis.start()
    telemetry = make_telemetry(private_redis.url)
    await telemetry.start()
    telemetry.put_fingerprints("acme", "gpt", b"\x01\x02")
    assert (
        await telemetry.get_fingerprints("acme", "gpt") == b"\x01\x02"
    )  # read-your-writes while queued
    await telemetry.writer.drain()
    fresh = make_telemetry(private_redis.url)
    assert await fresh.get_fingerprints("acme", "gpt", timeout_s=1.0) == b"\x01\x02"
    assert await fresh.get_fingerprints("acme", "other", timeout_s=1.0) is None
    private_redis.kill()
    began = time.monotonic()
    assert await fresh.get_fingerprints("acme", "gpt", timeout_s=0.05) is None
    # bounded by its own timeout, not by the store's connect timeout (seconds): far from both
    assert time.monotonic() - began < 2.0
    await fresh.aclose()
    await telemetry.aclose()
