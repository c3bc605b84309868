"""Hostile tenant, route and family names stay inside their own keys."""

import re
import time

from gateway.telemetry import RequestEvent
from gateway.telemetry.keys import KeySpace, escape_name
from tests.telemetry.telemetry_events import make_telemetry

HOSTILE = [
    "victim",  # an exact twin of the victim only in a different field (route) below
    "a:b",
    "{victim}",
    "victim}",
    "{t=victim}:openai:",
    "*",
    "ft:*",
    "x\ny",
    "\r\n*1\r\n$4\r\nPING\r\n",
    "é\u2028\x00",
    "\udcff",
    "A" * 10_000,
    "%" + "0" * 32,
    "victim ",
    "",
]
SAFE_PART = r"(?:[A-Za-z0-9._-]{1,64}|%[0-9a-f]{32})"


def _event(tenant: str, route: str, ttft_s: float, api: str = "chat") -> RequestEvent:
    return RequestEvent(
        tenant,
        route,
        "m",
        True,
        "ok",
        ttft_s,
        ttft_s / 2,
        1.0,
        prompt_tokens=10,
        api=api,
        ts=time.time(),
    )


def _snapshot(client, keys) -> dict:
    return {k: client.hgetall(k) if client.type(k) == b"hash" else client.get(k) for k in keys}


def test_escaped_names_are_key_safe_and_distinct() -> None:
    escaped = [escape_name(n) for n in HOSTILE]
    assert len(set(escaped)) == len(set(HOSTILE))
    assert all(re.fullmatch(SAFE_PART, e) for e in escaped)
    assert escape_name("victim") == "victim" and escape_name("victim ") != "victim"


async def test_hostile_names_cannot_touch_other_keys(
    redis_url: str, key_prefix: str, sync_redis
) -> None:
    outside_before = {
        k for k in sync_redis.scan_iter(count=1000) if not k.startswith(key_prefix.encode())
    }
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    keys = KeySpace(key_prefix)
    victim = _event("victim", "openai", 0.2)
    telemetry.record(victim)
    telemetry.put_fingerprints("victim", "gpt", b"victim-blob")
    await telemetry.writer.drain()
    victim_keys = [
        k.encode()
        for k in (
            keys.bucket("victim", "openai", int(victim.ts // 60)),  # its own minute
            keys.routes("victim"),
            keys.fingerprints("victim", "gpt"),
        )
    ]
    victim_before = _snapshot(sync_redis, victim_keys)
    assert all(victim_before.values())

    for name in HOSTILE[1:]:
        telemetry.record(_event(name, name, 0.9, api="responses"))
        telemetry.record(_event(name, "openai", 0.9))
        telemetry.record(_event("other", name, 0.9))
        telemetry.put_fingerprints(name, name, b"hostile")
        telemetry.put_fingerprints("victim", name, b"hostile")
    await telemetry.writer.drain()

    assert _snapshot(sync_redis, victim_keys) == victim_before
    (victim_route,) = (await telemetry.report("victim"))["routes"]
    assert victim_route["count"] == 1 and victim_route["route"] == "openai"
    assert await telemetry.get_fingerprints("victim", "gpt", timeout_s=1) == b"victim-blob"

    pattern = re.compile(
        rf"{re.escape(key_prefix)}:(?:tenants|(?:routes|apis):\{{t={SAFE_PART}\}}"
        rf"|ttft:\{{t={SAFE_PART}\}}:{SAFE_PART}:\d+(?::(?:completions|responses|messages))?"
        rf"|fp:\{{t={SAFE_PART}\}}:{SAFE_PART}"
        rf"|applied:\{{t={SAFE_PART}\}}:[0-9a-f]{{16}})"
    )
    ours = [k.decode() for k in sync_redis.scan_iter(match=f"{key_prefix}:*", count=1000)]
    assert ours and all(pattern.fullmatch(k) for k in ours), [
        k for k in ours if not pattern.fullmatch(k)
    ]
    outside_after = {
        k for k in sync_redis.scan_iter(count=1000) if not k.startswith(key_prefix.encode())
    }
    assert outside_after - outside_before == set()

    # Each hostile name reads back its own figures under its own exact name.
    for name in ["a:b", "{victim}", "x\ny", "A" * 10_000, ""]:
        report = await telemetry.report(name)
        assert {r["route"]: r["count"] for r in report["routes"]} == {name: 1, "openai": 1}
    assert set(HOSTILE[1:]) - {"\udcff"} <= set(await telemetry.known_tenants())
    await telemetry.aclose()
