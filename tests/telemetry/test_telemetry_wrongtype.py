"""A key of the wrong type in Redis loses only itself, on write and on read, with one log line
naming it; the rest of the batch counts exactly once and reports keep working."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.aggregate import minute_of
from gateway.telemetry.keys import KeySpace
from tests.telemetry.telemetry_events import make_telemetry


def _event(tenant: str, route: str, ts: float) -> RequestEvent:
    return RequestEvent(tenant, route, "m", True, "ok", 0.2, 0.1, 1.0, ts=ts)


def _counts(report: dict) -> dict[str, int]:
    return {r["route"]: r["count"] for r in report["routes"]}


def _lines_naming(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if key in r.getMessage()]


@pytest.fixture
async def telemetry(redis_url, key_prefix):
    telemetry = make_telemetry(
        redis_url, metrics_key_prefix=key_prefix, flush_interval_s=0.02, flush_batch=4
    )
    await telemetry.start()
    yield telemetry
    await telemetry.aclose()


async def _record_and_settle(telemetry: Telemetry, events: list[RequestEvent]) -> None:
    target = telemetry.writer.written + len(events)
    for event in events:
        telemetry.record(event)
    deadline = time.monotonic() + 5
    while telemetry.writer.written < target and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert telemetry.writer.written == target
    await asyncio.sleep(0.3)  # a writer that re-sent batches would keep counting meanwhile


async def test_string_in_a_bucket_loses_that_bucket_only(telemetry, key_prefix, sync_redis, caplog):
    """The issue's case: before, 10 requests were counted 64, 97, 130... and climbing."""
    now = time.time()
    keys = KeySpace(key_prefix)
    poisoned = keys.bucket("acme", "r1", minute_of(now))
    sync_redis.set(poisoned, "not a hash")
    events = [_event("acme", f"r{i % 2}", now) for i in range(10)]
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        await _record_and_settle(telemetry, events)
        assert _counts(await telemetry.report("acme")) == {"r0": 5}
        await _record_and_settle(telemetry, events)  # more batches hit the same bad key
        assert _counts(await telemetry.report("acme")) == {"r0": 10}
    assert sync_redis.get(poisoned) == b"not a hash"  # left alone for the operator
    lines = _lines_naming(caplog, poisoned)
    assert len(lines) == 1 and "is not a hash (string)" in lines[0]
    assert telemetry.writer.dropped == 0 and telemetry.health()["state"] == "ok"


async def test_wrong_type_met_on_read_skips_that_bucket(telemetry, key_prefix, sync_redis, caplog):
    now = time.time()
    await _record_and_settle(
        telemetry,
        [_event("acme", "r0", now - 60), _event("acme", "r0", now), _event("acme", "r1", now)],
    )
    earlier = KeySpace(key_prefix).bucket("acme", "r0", minute_of(now - 60))
    sync_redis.delete(earlier)
    sync_redis.rpush(earlier, "a list now")
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        assert _counts(await telemetry.report("acme")) == {"r0": 1, "r1": 1}
        assert _counts(await telemetry.report("acme")) == {"r0": 1, "r1": 1}
    lines = _lines_naming(caplog, earlier)
    assert len(lines) == 1 and "not read" in lines[0]


async def test_bucket_with_a_field_that_is_not_a_counter(telemetry, key_prefix, sync_redis, caplog):
    now = time.time()
    keys = KeySpace(key_prefix)
    spoilt = keys.bucket("acme", "r1", minute_of(now))
    sync_redis.hset(spoilt, "n", "lots")
    out_of_range = keys.bucket("acme", "r2", minute_of(now))
    sync_redis.hset(out_of_range, "t:999999999", 1)  # would overflow the histogram bounds
    events = [_event("acme", f"r{i % 3}", now) for i in range(9)]
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        await _record_and_settle(telemetry, events)
        assert _counts(await telemetry.report("acme")) == {"r0": 3}
    assert len(_lines_naming(caplog, spoilt)) == 1
    assert len(_lines_naming(caplog, out_of_range)) == 1
    assert "not a counter" in _lines_naming(caplog, out_of_range)[0]


async def test_unknown_fields_are_ignored_not_fatal(telemetry, key_prefix, sync_redis):
    """A newer gateway sharing the store may add fields; this one reads the ones it knows."""
    now = time.time()
    sync_redis.hset(KeySpace(key_prefix).bucket("acme", "r0", minute_of(now)), "new:field", 7)
    await _record_and_settle(telemetry, [_event("acme", "r0", now)])
    assert _counts(await telemetry.report("acme")) == {"r0": 1}


async def test_wrong_type_names_hashes(telemetry, key_prefix, sync_redis, caplog):
    now = time.time()
    keys = KeySpace(key_prefix)
    sync_redis.set(keys.routes("globex"), "x")
    events = [_event(t, "r0", now) for t in ("acme", "globex") for _ in range(3)]
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        await _record_and_settle(telemetry, events)
        assert _counts(await telemetry.report("acme")) == {"r0": 3}
        assert _counts(await telemetry.report("globex")) == {}  # its route names are gone
        assert [t["tenant"] for t in (await telemetry.report("*"))["tenants"]] == ["acme"]
        # globex's counters were still written: an operator who deletes the bad key gets
        # them back as soon as the route is named again.
        sync_redis.delete(keys.routes("globex"))
        await _record_and_settle(telemetry, [_event("globex", "r0", now)])
        assert _counts(await telemetry.report("globex")) == {"r0": 4}

        sync_redis.delete(keys.tenants())
        sync_redis.sadd(keys.tenants(), "a set")
        await _record_and_settle(telemetry, events)
        assert (await telemetry.report("*"))["tenants"] == []
        assert _counts(await telemetry.report("acme")) == {"r0": 6}
    assert len(_lines_naming(caplog, keys.routes("globex"))) == 1  # one line per key and period
    tenant_lines = _lines_naming(caplog, keys.tenants())
    assert len(tenant_lines) == 1 and "(set)" in tenant_lines[0]
    assert telemetry.writer.dropped == 0


async def test_fingerprint_key_of_the_wrong_type(telemetry, key_prefix, sync_redis, caplog):
    key = KeySpace(key_prefix).fingerprints("acme", "gpt")
    sync_redis.hset(key, "a", "b")
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        assert await telemetry.get_fingerprints("acme", "gpt", timeout_s=1) is None
    assert len(_lines_naming(caplog, key)) == 1
    telemetry.put_fingerprints("acme", "gpt", b"fresh")  # SET replaces any type
    await telemetry.writer.drain()
    assert await telemetry.get_fingerprints("acme", "gpt", timeout_s=1) == b"fresh"
