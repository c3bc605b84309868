"""`Telemetry.health()` tells the truth about the store while requests flow and while idle:
degraded when Redis is unreachable, ok again once it answers."""

from __future__ import annotations

import time

from gateway.config.settings import Settings
from gateway.telemetry import RequestEvent, Telemetry, writer
from gateway.telemetry.store import MemoryStore
from tests.telemetry.telemetry_events import make_telemetry, until


def _event(ts: float) -> RequestEvent:
    return RequestEvent("acme", "r0", "m", True, "ok", 0.2, 0.1, 1.0, ts=ts)


def _state(telemetry: Telemetry) -> str:
    return telemetry.health()["state"]


async def test_health_follows_redis_down_and_back(private_redis, monkeypatch):
    monkeypatch.setattr(writer, "HEALTH_PROBE_S", 0.2)
    private_redis.start()
    telemetry = make_telemetry(private_redis.url, flush_interval_s=0.02, telemetry_buffer=50)
    await telemetry.start()
    try:
        assert await until(lambda: telemetry.writer._last_contact > 0, 2)  # probed at start
        assert telemetry.health() == {
            "store": "redis",
            "state": "ok",
            "buffered": 0,
            "dropped": 0,
            "failures": 0,
        }

        private_redis.kill()
        assert await until(lambda: _state(telemetry) == "degraded", 3)  # idle: the probe
        for _ in range(60):  # requests flow meanwhile: buffered up to the bound, then dropped
            telemetry.record(_event(time.time()))
        health = telemetry.health()
        assert health["state"] == "degraded" and health["failures"] >= 1
        assert (health["buffered"], health["dropped"]) == (50, 10)

        private_redis.start()
        assert await until(lambda: _state(telemetry) == "ok", 10)
        assert await until(lambda: telemetry.writer.buffered == 0, 5)
        assert telemetry.health()["failures"] == 0
        assert sum(r["count"] for r in (await telemetry.report("acme"))["routes"]) == 50
    finally:
        await telemetry.aclose()


async def test_health_degraded_when_redis_is_down_from_the_start(private_redis):
    private_redis.start()
    url = private_redis.url
    private_redis.kill()
    telemetry = make_telemetry(url, flush_interval_s=0.02)
    await telemetry.start()
    try:
        assert await until(lambda: _state(telemetry) == "degraded", 3)
    finally:
        await telemetry.aclose(timeout_s=0.5)


async def test_health_of_memory_and_disabled_telemetry():
    memory = Telemetry(MemoryStore(retention_s=60), Settings())
    assert memory.health()["store"] == "memory" and memory.health()["state"] == "ok"
    off = Telemetry(MemoryStore(retention_s=60), Settings(telemetry=False))
    assert off.health() == {"store": "off", "state": "disabled"}


def test_health_is_cheap():
    telemetry = Telemetry(MemoryStore(retention_s=60), Settings())
    for _ in range(10_000):
        telemetry.writer.enqueue(_event(time.time()))
    began = time.thread_time()  # this thread's CPU: another process's load does not count
    for _ in range(1000):
        telemetry.health()
    assert (time.thread_time() - began) / 1000 < 50e-6  # O(1): no scan of the buffer
