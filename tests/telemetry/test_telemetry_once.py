"""A batch is applied at most once: a write whose answer is lost after Redis applied it is
retried without counting twice, and a write Redis refuses for good is dropped once, counted
and logged, never re-sent."""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.aggregate import minute_of
from gateway.telemetry.keys import KeySpace
from gateway.telemetry.redis_store import RedisStore, connect
from tests.telemetry.telemetry_events import aggregate_events, make_telemetry, until

EXEC = b"$4\r\nEXEC\r\n"  # how redis-py sends EXEC, at the end of a MULTI/EXEC pipeline


class ReplyEater:
    """A loopback TCP proxy to Redis. Once armed, it passes the next EXEC on to Redis, waits
    for Redis to answer (so the transaction has been applied), then drops the client's
    connection instead of passing the answer on: the client cannot tell whether it applied."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.armed = False
        self.eaten = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/13"

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.redis_port)
        exec_sent = asyncio.Event()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                if self.armed and EXEC in data:
                    exec_sent.set()  # before forwarding, so the answer cannot overtake it
                redis_w.write(data)
                await redis_w.drain()
            redis_w.close()

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                if exec_sent.is_set():  # Redis answered the EXEC: it applied; lose the answer
                    self.armed = False
                    self.eaten += 1
                    client_w.transport.abort()
                    redis_w.close()
                    return
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


def _event(tenant: str, route: str, ts: float) -> RequestEvent:
    return RequestEvent(tenant, route, "m", True, "ok", 0.2, 0.1, 1.0, ts=ts)


async def _count(telemetry: Telemetry, tenant: str = "acme") -> int:
    return sum(r["count"] for r in (await telemetry.report(tenant))["routes"])


async def test_answer_lost_after_exec_is_not_counted_twice(redis_url, key_prefix, sync_redis):
    proxy = ReplyEater(6379)
    url = await proxy.start()
    telemetry = make_telemetry(url, metrics_key_prefix=key_prefix, flush_interval_s=0.02)
    reader = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    await telemetry.start()
    try:
        now = time.time()
        for i in range(10):
            telemetry.record(_event("acme" if i % 2 else "globex", f"r{i % 3}", now))
        await asyncio.sleep(0.2)
        assert telemetry.writer.written == 10 and await _count(reader) == 5

        proxy.armed = True
        for i in range(30):
            telemetry.record(_event("acme" if i % 2 else "globex", f"r{i % 3}", now))
        assert await until(lambda: telemetry.writer.written == 40, 5)
        assert proxy.eaten == 1  # the write was applied and its answer lost, once
        assert await _count(reader) == 20 and await _count(reader, "globex") == 20
        assert telemetry.writer.failures == 0 and telemetry.writer.dropped == 0
        markers = list(sync_redis.scan_iter(match=f"{key_prefix}:applied:*"))
        assert len(markers) == 2  # one per tenant for this writer, not one per batch
        assert all(0 < sync_redis.ttl(m) <= 86400 for m in markers)
    finally:
        await telemetry.aclose()
        await reader.aclose()
        await proxy.aclose()


async def test_same_batch_id_applies_once_and_a_new_one_applies(redis_url, key_prefix):
    store = RedisStore(connect(redis_url), KeySpace(key_prefix), retention_s=3600)
    now = time.time()
    minute = minute_of(now)
    aggregate = aggregate_events([_event("acme", "r0", now), _event("acme", "r1", now)])
    try:
        for _ in range(3):
            await store.write(aggregate, {}, batch=("w1", 7))
        assert sum(f["n"] for f in (await store.read("acme", minute, minute)).values()) == 2
        await store.write(aggregate, {}, batch=("w1", 6))  # an older batch of the same writer
        assert sum(f["n"] for f in (await store.read("acme", minute, minute)).values()) == 2
        await store.write(aggregate, {}, batch=("w1", 8))
        await store.write(aggregate, {}, batch=("w2", 1))  # another writer process
        await store.write(aggregate, {})  # no id: each call is its own batch
        assert sum(f["n"] for f in (await store.read("acme", minute, minute)).values()) == 8
    finally:
        await store.aclose()


async def test_refused_batch_is_dropped_once_and_the_writer_moves_on(private_redis, caplog):
    private_redis.start()
    admin = redis.Redis(port=private_redis.port)
    telemetry = make_telemetry(private_redis.url, flush_interval_s=0.02)
    await telemetry.start()
    calls_before = _exec_calls(admin)
    try:
        admin.acl_setuser(
            "default",
            enabled=True,
            nopass=True,
            commands=["+@all", "-eval"],
            keys=["*"],
            channels=["*"],
        )
        now = time.time()
        with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
            for _ in range(10):
                telemetry.record(_event("acme", "r0", now))
            assert await until(lambda: telemetry.writer.buffered == 0, 5)
            await asyncio.sleep(0.3)
        assert telemetry.writer.dropped == 10 and telemetry.writer.written == 0
        lost = telemetry.writer.lost_batches
        assert 1 <= lost <= 2 and _exec_calls(admin) - calls_before == lost  # never re-sent
        lines = [r.getMessage() for r in caplog.records if "could not be written" in r.message]
        assert len(lines) == 1 and "no permissions" in lines[0]
        assert telemetry.health()["state"] == "ok"  # the store answers: not an outage

        admin.acl_setuser(
            "default",
            enabled=True,
            nopass=True,
            commands=["+@all"],
            keys=["*"],
            channels=["*"],
            reset=True,
        )
        for _ in range(5):
            telemetry.record(_event("acme", "r0", now))
        assert await until(lambda: telemetry.writer.written == 5, 5)
        assert await _count(telemetry) == 5
    finally:
        await telemetry.aclose()
        admin.close()


def _exec_calls(admin: redis.Redis) -> int:
    """Transactions Redis saw (`calls` includes those that failed, not those it rejected)."""
    stats = admin.info("commandstats").get("cmdstat_exec", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))
