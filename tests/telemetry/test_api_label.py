"""Figures per client API (chat, completions, responses, messages): the store keeps them apart
for one tenant, the JSON endpoint filters and breaks down by them, `/metrics` labels them."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from gateway.boundary.auth import KeyRing
from gateway.config.keys import parse_admin_keys, parse_tenant_keys
from gateway.ops.metrics import metrics_endpoints
from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.aggregate import fold_event
from gateway.telemetry.cli import metrics_main
from gateway.telemetry.event import APIS
from gateway.telemetry.keys import KeySpace
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.report import SloConfig, tenant_report
from tests.support.gateway import admission_for
from tests.telemetry.prometheus_quantile import samples
from tests.telemetry.telemetry_events import aggregate_events, make_telemetry

# (api, route, ttft seconds, prompt tokens, cached tokens, tokens saved): a count of each api
# and token figures that differ, so a request in the wrong bucket shows in every sum.
ACME = [
    ("chat", "openai", 0.10, 100, 10, 1),
    ("chat", "openai", 0.12, 100, 10, 1),
    ("chat", "local", 0.11, 100, 10, 1),
    ("completions", "openai", 0.20, 200, 20, 2),
    ("responses", "openai", 0.40, 400, 40, 4),
    ("responses", "openai", 0.42, 400, 40, 4),
    ("responses", "local", 0.44, 400, 40, 4),
    ("messages", "local", 0.80, 800, 80, 8),
]


def _event(tenant: str, api: str, route: str, ttft: float, prompt: int, cached: int, saved: int):
    return RequestEvent(
        tenant,
        route,
        "m",
        True,
        "ok",
        ttft,
        ttft * 0.9,
        ttft + 1.0,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        prompt_tokens_saved=saved,
        api=api,
        ts=time.time() - 30,
    )


def _events() -> list[RequestEvent]:
    acme = [_event("acme", *row) for row in ACME]
    # Another tenant on the same routes and APIs, with figures acme must never see.
    globex = [_event("globex", api, "openai", 5.0, 9000, 9000, 900) for api in APIS]
    return acme + globex


def _expected(api: str | None = None, route: str | None = None) -> dict[str, int]:
    rows = [r for r in ACME if api in (None, r[0]) and route in (None, r[1])]
    return {
        "count": len(rows),
        "prompt_tokens": sum(r[3] for r in rows),
        "cached_prompt_tokens": sum(r[4] for r in rows),
        "prompt_tokens_saved": sum(r[5] for r in rows),
    }


def _figures(entry: dict) -> dict[str, int]:
    return {name: entry[name] for name in _expected()}


@pytest.fixture(params=["memory", "redis"])
async def telemetry(request) -> AsyncIterator[Telemetry]:
    """`_events()` recorded as the gateway records them, in each store. The Redis fixtures are
    requested by the Redis case only, so the memory case runs without a Redis."""
    if request.param == "memory":
        recorded = make_telemetry()
    else:
        redis_url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("key_prefix")
        recorded = make_telemetry(redis_url, metrics_key_prefix=prefix)
    await recorded.start()
    for event in _events():
        recorded.record(event)
    await recorded.writer.drain()
    yield recorded
    await recorded.aclose()


def test_timing_hands_its_api_to_the_event() -> None:
    timing = RequestRecord(tenant="acme", model="m", stream=True)
    assert timing.to_event().api == "chat"
    timing.api = "responses"
    assert timing.to_event().api == "responses"


async def test_each_api_lands_in_its_own_bucket(telemetry: Telemetry) -> None:
    now = time.time()
    first, last = int((now - 3600) // 60), int(now // 60)
    split = await telemetry.store.read_split("acme", first, last)
    assert set(split) == {(r[1], r[0]) for r in ACME}
    for (route, api), fields in split.items():
        expected = _expected(api, route)
        assert fields["n"] == expected["count"], (route, api)
        assert fields["prompt"] == expected["prompt_tokens"]
        assert fields["cached"] == expected["cached_prompt_tokens"]
        assert fields["saved"] == expected["prompt_tokens_saved"]
    per_route = await telemetry.store.read("acme", first, last)  # summed over APIs, as before
    assert {r: int(f["n"]) for r, f in per_route.items()} == {"openai": 5, "local": 3}


async def test_report_breaks_down_and_filters_by_api(telemetry: Telemetry) -> None:
    everything = await telemetry.report("acme")
    assert everything["api"] is None
    assert [a["api"] for a in everything["by_api"]] == list(APIS)
    for entry in everything["by_api"]:
        assert _figures(entry) == _expected(entry["api"]), entry["api"]
    assert sum(a["count"] for a in everything["by_api"]) == len(ACME)
    (messages,) = [a for a in everything["by_api"] if a["api"] == "messages"]
    assert messages["ttft_ms"]["mean"] == 800.0  # only the one 0.8 s request
    for route in everything["routes"]:
        assert _figures(route) == _expected(route=route["route"])

    responses = await telemetry.report("acme", api="responses")
    assert responses["api"] == "responses"
    assert [a["api"] for a in responses["by_api"]] == ["responses"]
    assert _figures(responses["by_api"][0]) == _expected("responses")
    assert {r["route"]: _figures(r) for r in responses["routes"]} == {
        route: _expected("responses", route) for route in ("openai", "local")
    }
    nobody = await telemetry.report("nobody", api="chat")
    assert nobody["routes"] == [] and nobody["by_api"] == []
    with pytest.raises(ValueError, match="unknown api"):
        await telemetry.report("acme", api="embeddings")


async def test_tenants_never_see_each_others_api_figures(telemetry: Telemetry) -> None:
    globex = await telemetry.report("globex")
    assert [(a["api"], a["count"], a["prompt_tokens"]) for a in globex["by_api"]] == [
        (api, 1, 9000) for api in APIS
    ]
    for api in APIS:
        mine = await telemetry.report("acme", api=api)
        assert all(a["prompt_tokens"] != 9000 for a in mine["by_api"])
        assert sum(r["count"] for r in mine["routes"]) == _expected(api)["count"]
    everyone = await telemetry.report("*", api="messages")
    assert {t["tenant"]: t["by_api"][0]["count"] for t in everyone["tenants"]} == {
        "acme": 1,
        "globex": 1,
    }


async def test_redis_keys_and_one_round_trip(redis_url: str, key_prefix: str, sync_redis) -> None:
    """Chat keeps its pre-API key names; another API adds a suffix and names itself in the
    tenant's APIs hash; a batch of every API is still one pipeline round trip."""
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    store = telemetry.store
    executes = 0
    make_pipeline = store.client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a, **k):
            nonlocal executes
            executes += 1
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe

    store.client.pipeline = counting_pipeline
    try:
        await store.write(aggregate_events(_events()), {})
        assert executes == 1
        keys = KeySpace(key_prefix)
        minute = int((time.time() - 30) // 60)
        chat = keys.bucket("acme", "openai", minute)
        assert chat == f"{key_prefix}:ttft:{{t=acme}}:openai:{minute}"
        assert int(sync_redis.hget(chat, "n")) == 2
        responses = keys.bucket("acme", "openai", minute, "responses")
        assert responses == chat + ":responses"
        assert int(sync_redis.hget(responses, "n")) == 2
        assert int(sync_redis.hget(responses, "cached")) == 80
        assert sync_redis.hgetall(keys.apis("acme")) == {
            a.encode(): a.encode() for a in ("completions", "messages", "responses")
        }
        assert 0 < sync_redis.ttl(keys.apis("acme"))
        # A name no gateway writes in the APIs hash adds no reads and no figures.
        sync_redis.hset(keys.apis("acme"), "embeddings", "embeddings")
        report = await tenant_report(store, "acme", 3600, SloConfig(), time.time())
        assert [a["api"] for a in report["by_api"]] == list(APIS)
    finally:
        await telemetry.aclose()


async def test_a_chat_only_tenant_writes_no_new_keys(
    redis_url: str, key_prefix: str, sync_redis
) -> None:
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    try:
        await telemetry.store.write(aggregate_events([_event("acme", *ACME[0])]), {})
        ours = {k.decode() for k in sync_redis.scan_iter(match=f"{key_prefix}:*")}
        assert not any(":apis:" in k or k.endswith(APIS[1:]) for k in ours), ours
    finally:
        await telemetry.aclose()


def test_an_unknown_api_is_refused_as_a_bug(caplog) -> None:
    """The gateway sets `api`; another name is a bug: logged, counted nowhere, never raised."""
    bad = _event("acme", "embeddings", "openai", 0.3, 100, 10, 1)
    aggregate: dict = {}
    with pytest.raises(ValueError, match="unknown api"):
        fold_event(aggregate, bad)
    assert aggregate == {}
    telemetry = make_telemetry()
    telemetry.record(bad)  # never raises
    parsed = samples(telemetry.prometheus_exposition()[0].decode())
    assert not [s for s in parsed if s.labels.get("api") == "embeddings"]
    assert not [s for s in parsed if s.name == "firsttoken_requests_total"]
    assert "telemetry record failed" in caplog.text


def test_prometheus_labels_every_api() -> None:
    telemetry = make_telemetry()
    for event in _events():
        telemetry.record(event)
    parsed = samples(telemetry.prometheus_exposition()[0].decode())

    def value(name: str, api: str, **labels: str) -> float:
        want = {"tenant": "acme", "api": api, **labels}
        return sum(
            s.value
            for s in parsed
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items())
        )

    for api in APIS:
        expected = _expected(api)
        assert value("firsttoken_ttft_seconds_count", api) == expected["count"]
        assert value("firsttoken_requests_total", api, status="ok") == expected["count"]
        assert (
            value("firsttoken_cached_prompt_tokens_total", api) == expected["cached_prompt_tokens"]
        )
        assert value("firsttoken_prompt_tokens_saved_total", api) == expected["prompt_tokens_saved"]
    assert value("firsttoken_ttft_seconds_bucket", "responses", le="+Inf", route="openai") == 2


# --- the JSON endpoint, on the gateway's own routes and key ring --------------------------

KEYS = "acme:key-a,globex:key-b"


@pytest.fixture
async def endpoint() -> AsyncIterator[httpx.AsyncClient]:
    telemetry = make_telemetry()
    await telemetry.store.write(aggregate_events(_events()), {})
    keys = KeyRing(parse_tenant_keys(KEYS), parse_admin_keys("root-key"))
    app = Starlette(routes=metrics_endpoints(admission_for(keys), telemetry, dict))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway"
    ) as client:
        yield client


async def _get(client: httpx.AsyncClient, key: str, **params: str) -> httpx.Response:
    return await client.get(
        "/v1/metrics/ttft", params=params, headers={"authorization": f"Bearer {key}"}
    )


async def test_endpoint_filters_and_breaks_down_by_api(endpoint: httpx.AsyncClient) -> None:
    body = (await _get(endpoint, "key-a")).json()
    assert body["tenant"] == "acme" and body["api"] is None
    assert {a["api"]: _figures(a) for a in body["by_api"]} == {a: _expected(a) for a in APIS}
    filtered = await _get(endpoint, "key-a", api="responses")
    assert filtered.status_code == 200
    body = filtered.json()
    assert body["api"] == "responses" and [a["api"] for a in body["by_api"]] == ["responses"]
    assert sum(r["count"] for r in body["routes"]) == 3
    everyone = (await _get(endpoint, "root-key", tenant="*", api="messages")).json()
    assert sorted(t["tenant"] for t in everyone["tenants"]) == ["acme", "globex"]


async def test_endpoint_refuses_an_unknown_api(endpoint: httpx.AsyncClient) -> None:
    for bad in ("embeddings", "", "Chat", "chat "):
        response = await _get(endpoint, "key-a", api=bad)
        assert response.status_code == 400, bad
        error = response.json()["error"]
        assert error["param"] == "api" and error["type"] == "invalid_request_error"
        assert "responses" in error["message"]


async def test_endpoint_keeps_tenants_apart_per_api(endpoint: httpx.AsyncClient) -> None:
    for api in APIS:
        mine = (await _get(endpoint, "key-b", api=api)).json()
        assert mine["tenant"] == "globex"
        assert [(a["api"], a["count"], a["prompt_tokens"]) for a in mine["by_api"]] == [
            (api, 1, 9000)
        ]
    denied = await _get(endpoint, "key-b", tenant="acme", api="responses")
    assert denied.status_code == 403


async def test_cli_filters_by_api_and_prints_the_api_rows(redis_url: str, key_prefix: str) -> None:
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    try:
        await telemetry.store.write(aggregate_events(_events()), {})
        expected = await telemetry.report("acme", api="responses")
    finally:
        await telemetry.aclose()
    common = ["--redis-url", redis_url, "--prefix", key_prefix, "--tenant", "acme"]

    def run(*argv: str) -> str:
        out = io.StringIO()
        assert metrics_main([*common, *argv], environ={}, out=out) == 0
        return out.getvalue()

    # The CLI runs its own event loop: off this test's loop, as from a terminal.
    as_json = await asyncio.to_thread(run, "--api", "responses", "--json")
    assert json.loads(as_json) == expected
    table = await asyncio.to_thread(run)
    routes, apis = table.split("\n\n")
    assert {line.split()[1] for line in routes.splitlines()[1:]} == {"openai", "local"}
    assert apis.splitlines()[0].split()[:3] == ["tenant", "api", "count"]
    rows = {line.split()[1]: line.split()[2] for line in apis.splitlines()[1:-1]}
    assert rows == {api: str(_expected(api)["count"]) for api in APIS}


async def test_a_wrong_type_apis_key_loses_only_the_other_apis(
    redis_url: str, key_prefix: str, sync_redis, caplog
) -> None:
    keys = KeySpace(key_prefix)
    sync_redis.set(keys.apis("acme"), "not a hash")
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    try:
        await telemetry.store.write(aggregate_events(_events()), {})
        report = await telemetry.report("acme")
    finally:
        await telemetry.aclose()
    assert [(a["api"], a["count"]) for a in report["by_api"]] == [("chat", 3)]
    assert sync_redis.get(keys.apis("acme")) == b"not a hash"
    assert keys.apis("acme") in caplog.text
