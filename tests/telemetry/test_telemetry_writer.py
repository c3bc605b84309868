import asyncio
import time

import redis.exceptions

from gateway.config.settings import Settings
from gateway.telemetry import RequestEvent, Telemetry, redis_store
from gateway.telemetry.store import MemoryStore


class SwitchableStore(MemoryStore):
    """A memory store whose writes fail like an unreachable Redis while `down` is set."""

    def __init__(self) -> None:
        super().__init__(retention_s=3600)
        self.down = False
        self.attempts = 0
        self.batch_sizes: list[int] = []

    async def write(self, aggregate, blobs, batch=None) -> None:
        self.attempts += 1
        if self.down:
            raise redis.exceptions.ConnectionError("connection refused")
        self.batch_sizes.append(sum(int(f.get("n", 0)) for f in aggregate.values()))
        await super().write(aggregate, blobs)

    def is_transient(self, exc: BaseException) -> bool:
        return redis_store.is_transient(exc)


def _event(i: int = 0) -> RequestEvent:
    return RequestEvent("acme", f"r{i % 3}", "m", True, "ok", 0.2, 0.1, 1.0, ts=time.time())


async def _count(telemetry: Telemetry) -> int:
    return sum(r["count"] for r in (await telemetry.report("acme"))["routes"])


async def test_full_batch_flushes_before_the_interval() -> None:
    store = SwitchableStore()
    telemetry = Telemetry(store, Settings(), flush_interval_s=30, flush_batch=100)
    await telemetry.start()
    for i in range(250):
        telemetry.record(_event(i))
    await asyncio.sleep(0.05)
    assert telemetry.writer.written >= 200  # two full batches went without waiting 30 s
    assert max(store.batch_sizes) <= 100
    await telemetry.aclose()
    assert await _count(telemetry) == 250


async def test_outage_keeps_the_oldest_events_up_to_the_bound_and_backs_off() -> None:
    store = SwitchableStore()
    telemetry = Telemetry(
        store, Settings(telemetry_buffer=50), flush_interval_s=0.01, flush_batch=20
    )
    await telemetry.start()
    store.down = True
    for i in range(80):
        telemetry.record(_event(i))
    await asyncio.sleep(0.5)
    # Backoff doubles from 50 ms: about 4 attempts in 0.5 s, not one per 10 ms interval.
    assert 2 <= store.attempts <= 8, store.attempts
    assert (telemetry.writer.buffered, telemetry.dropped) == (50, 30)
    store.down = False
    deadline = time.monotonic() + 5
    while telemetry.writer.buffered and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert await _count(telemetry) == 50 and telemetry.writer.failures == 0
    await telemetry.aclose()


async def test_malformed_event_is_dropped_alone() -> None:
    telemetry = Telemetry(SwitchableStore(), Settings())
    telemetry.record(_event())
    telemetry.record(RequestEvent("acme", "r0", "m", True, "ok", "soon", None, 1.0))  # type: ignore[arg-type]
    telemetry.record(_event())
    await telemetry.writer.drain()
    assert await _count(telemetry) == 2
    assert telemetry.dropped == 1 and telemetry.writer.written == 2


async def test_fingerprints_latest_put_wins() -> None:
    telemetry = Telemetry(SwitchableStore(), Settings())
    telemetry.put_fingerprints("acme", "gpt", b"one")
    telemetry.put_fingerprints("acme", "gpt", b"two")
    await telemetry.writer.drain()
    assert await telemetry.get_fingerprints("acme", "gpt") == b"two"
    assert await telemetry.get_fingerprints("acme", "claude") is None


class CountingStore(SwitchableStore):
    """Counts the writer's pings (an idle writer's only contact with the store)."""

    def __init__(self) -> None:
        super().__init__()
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1


async def test_an_idle_writer_sleeps_until_there_is_something_to_write() -> None:
    store = CountingStore()
    telemetry = Telemetry(store, Settings(), flush_interval_s=0.01, flush_batch=100)
    await telemetry.start()
    woken = 0
    drain_or_probe = telemetry.writer._drain_or_probe

    async def counted() -> None:
        nonlocal woken
        woken += 1
        await drain_or_probe()

    telemetry.writer._drain_or_probe = counted  # type: ignore[method-assign]
    await asyncio.sleep(0.3)
    # Its first probe at most; woken every 10 ms interval it would have come here ~30 times.
    assert woken <= 1 and store.pings <= 1
    telemetry.record(_event())
    deadline = time.monotonic() + 10
    while not telemetry.writer.written and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert telemetry.writer.written == 1 and await _count(telemetry) == 1
    await telemetry.aclose()
