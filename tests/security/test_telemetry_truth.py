"""Telemetry cannot lie: keys of the wrong type planted in the shared Redis cost only
themselves (never a re-count, never another tenant's figures), and a Redis that goes away
shows as degraded telemetry while requests keep flowing."""

from __future__ import annotations

import logging
import time

import httpx
import redis

from gateway.telemetry.aggregate import minute_of
from gateway.telemetry.keys import KeySpace
from tests.security.conftest import ADMIN_KEY, TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client
from tests.support.gateway import openai_route


def _chat(gw, key: str, n: int) -> None:
    client = sdk_client(gw, key)
    for _ in range(n):
        reply = client.chat.completions.create(
            model="mock-1", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content


def _count(gw, key: str) -> int:
    r = httpx.get(gw.url + "/v1/metrics/ttft", headers=auth(key), timeout=5)
    assert r.status_code == 200, r.text
    return sum(route["count"] for route in r.json()["routes"])


def test_planted_wrong_types_cost_only_themselves(
    key_prefix, redis_url, mock_upstream, make_gateway, tenant_settings, caplog
):
    # `key_prefix` first: its clean-up then runs after the gateway's last flush at shutdown.
    gw = make_gateway(
        [openai_route(mock_upstream)],
        redis_url=redis_url,
        metrics_key_prefix=key_prefix,
        policies="none",
        **tenant_settings,
    )
    planted = redis.Redis.from_url(redis_url)
    keys = KeySpace(key_prefix)
    now = minute_of(time.time())
    poisoned = [keys.bucket("globex", "mock", m) for m in (now, now + 1)]
    for key in poisoned:  # this minute and the next, whichever the requests land in
        planted.set(key, "planted")
    with caplog.at_level(logging.ERROR, logger="firsttoken.telemetry"):
        _chat(gw, TENANT_A_KEY, 10)
        _chat(gw, TENANT_B_KEY, 10)
        deadline = time.monotonic() + 5
        while _count(gw, TENANT_A_KEY) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = []
        for _ in range(5):  # a writer that re-applied batches would keep climbing
            time.sleep(0.1)
            counts.append(_count(gw, TENANT_A_KEY))
    assert counts == [10] * 5
    assert _count(gw, TENANT_B_KEY) == 0  # its only bucket was the planted one
    assert all(planted.get(key) == b"planted" for key in poisoned)
    # Each planted key is named, once per way it was met (written, read), never once per
    # request: the requests may straddle a minute and meet both keys.
    named = [r.getMessage() for r in caplog.records if key_prefix in r.getMessage()]
    assert 1 <= len(named) <= 2 * len(poisoned), named
    assert all(any(key in message for key in poisoned) for message in named), named
    assert len(set(named)) == len(named), named
    admin = httpx.get(gw.url + "/v1/metrics/ttft?tenant=*", headers=auth(ADMIN_KEY), timeout=5)
    assert admin.status_code == 200
    assert [t["tenant"] for t in admin.json()["tenants"]] == ["acme"]
    assert gw.runtime.telemetry.health()["state"] == "ok"
    assert gw.runtime.telemetry.dropped == 0
    planted.close()


def test_unreachable_redis_degrades_telemetry_while_requests_flow(
    private_redis, mock_upstream, make_gateway, tenant_settings
):
    private_redis.start()
    gw = make_gateway(
        [openai_route(mock_upstream)],
        redis_url=private_redis.url,
        policies="none",
        **tenant_settings,
    )
    _chat(gw, TENANT_A_KEY, 2)
    assert gw.runtime.telemetry.health()["state"] == "ok"
    private_redis.kill()
    _chat(gw, TENANT_A_KEY, 3)  # requests keep flowing
    deadline = time.monotonic() + 5
    while gw.runtime.telemetry.health()["state"] != "degraded":
        assert time.monotonic() < deadline, gw.runtime.telemetry.health()
        time.sleep(0.05)
    ready = httpx.get(gw.url + "/readyz")  # what an operator sees: ready, telemetry degraded
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert ready.json()["telemetry"]["state"] == "degraded"
    assert ready.json()["telemetry"]["store"] == "redis"
    private_redis.start()
    deadline = time.monotonic() + 10
    while gw.runtime.telemetry.health()["state"] != "ok":
        assert time.monotonic() < deadline, gw.runtime.telemetry.health()
        time.sleep(0.05)
