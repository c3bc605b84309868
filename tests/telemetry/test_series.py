"""TTFT over time (`/v1/metrics/ttft/series`): minutes merged into aligned steps, windows and
their bounds, route and API filters, tenants kept apart, both stores, and gateway processes
whose Redis buckets merge."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from bench.harness import free_port
from gateway.boundary.auth import KeyRing
from gateway.config.keys import parse_admin_keys, parse_tenant_keys
from gateway.ops.metrics import metrics_endpoints
from gateway.telemetry import RequestEvent, Telemetry
from gateway.telemetry.keys import KeySpace
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.redis_store import RedisStore
from gateway.telemetry.report import SloConfig, tenant_report
from gateway.telemetry.series import (
    MAX_POINTS,
    max_points,
    series_problem,
    step_starts,
    tenant_series,
)
from gateway.telemetry.store import MemoryStore
from tests.support.clients import sdk_client
from tests.support.gateway import admission_for, openai_route
from tests.telemetry.telemetry_events import (
    aggregate_events,
    make_events,
    make_telemetry,
    write_in_processes,
)

BODY_KEYS = {"tenant", "window_s", "step_s", "route", "api", "slo_ms", "routes", "points"}
POINT_KEYS = {
    "t",
    "count",
    "errors",
    "hedges",
    "ttft_ms",
    "upstream_ttft_ms",
    "gateway_ms",
    "gateway_share",
    "cached_share",
    "prompt_tokens_saved",
    "slo_attainment",
}
NO_QUANTILES = {"p50": None, "p90": None, "p99": None}


def _event(
    ts: float,
    tenant: str = "acme",
    route: str = "openai",
    ttft: float = 0.2,
    api: str = "chat",
    status: str = "ok",
    hedged: bool = False,
    prompt: int = 100,
    cached: int = 40,
) -> RequestEvent:
    return RequestEvent(
        tenant,
        route,
        "m",
        True,
        status,
        ttft,
        ttft * 0.9,
        ttft + 1.0,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        prompt_tokens_saved=3,
        api=api,
        hedged=hedged,
        ts=ts,
    )


@pytest.fixture(params=["memory", "redis"])
async def telemetry(request) -> AsyncIterator[Telemetry]:
    """An empty telemetry over each store; the Redis case alone asks for the Redis fixtures."""
    if request.param == "memory":
        made = make_telemetry()
    else:
        made = make_telemetry(
            request.getfixturevalue("redis_url"),
            metrics_key_prefix=request.getfixturevalue("key_prefix"),
        )
    yield made
    await made.aclose()


async def _write(telemetry: Telemetry, events: list[RequestEvent]) -> None:
    await telemetry.store.write(aggregate_events(events), {})


def _by_t(body: dict, name: str = "count") -> dict[int, Any]:
    return {p["t"]: p[name] for p in body["points"]}


# --- steps and windows -----------------------------------------------------------------------


async def test_minutes_merge_into_aligned_steps(telemetry: Telemetry) -> None:
    now = time.time()
    starts = step_starts(3600, 300, now)
    assert len(starts) == 13  # a window of whole steps touches one more, partly
    events = (
        [_event(starts[2] + 5) for _ in range(3)]  # first minute of a step ...
        + [_event(starts[2] + 299, status="timeout") for _ in range(2)]  # ... and its last
        + [_event(starts[5] + 61, hedged=True) for _ in range(4)]
        + [_event(min(now, starts[-1] + 1))]  # the step still filling
        + [_event(starts[0] - 60)]  # before the window
    )
    await _write(telemetry, events)
    body = await tenant_series(telemetry.store, "acme", 3600, 300, SloConfig(), now)
    assert set(body) == BODY_KEYS
    assert (body["tenant"], body["window_s"], body["step_s"]) == ("acme", 3600, 300)
    assert body["route"] is None and body["api"] is None and body["routes"] == ["openai"]
    assert [p["t"] for p in body["points"]] == list(starts)
    assert all(set(p) == POINT_KEYS and p["t"] % 300 == 0 for p in body["points"])
    counts = {t: c for t, c in _by_t(body).items() if c}
    assert counts == {starts[2]: 5, starts[5]: 4, starts[-1]: 1}
    assert _by_t(body, "errors")[starts[2]] == 2
    assert _by_t(body, "hedges") == {t: 4 if t == starts[5] else 0 for t in starts}
    busy = body["points"][5]
    assert busy["cached_share"] == 0.4 and busy["prompt_tokens_saved"] == 12
    assert busy["ttft_ms"]["p50"] == pytest.approx(200, rel=0.03)
    assert busy["gateway_share"] == pytest.approx(0.1, rel=1e-6)
    empty = body["points"][0]
    assert empty == {
        "t": starts[0],
        "count": 0,
        "errors": 0,
        "hedges": 0,
        "ttft_ms": NO_QUANTILES,
        "upstream_ttft_ms": NO_QUANTILES,
        "gateway_ms": NO_QUANTILES,
        "gateway_share": None,
        "cached_share": None,
        "prompt_tokens_saved": 0,
        "slo_attainment": None,
    }


async def test_minute_steps_cover_the_reports_window(telemetry: Telemetry) -> None:
    """At one minute per step the points are the report's minutes: their sums are its sums."""
    now = time.time()
    await _write(telemetry, make_events(seed=5, count=600, now=now))
    report = await tenant_report(telemetry.store, "acme", 900, SloConfig(), now)
    body = await tenant_series(telemetry.store, "acme", 900, 60, SloConfig(), now)
    assert len(body["points"]) == 16
    for point_name, route_name in (
        ("count", "count"),
        ("errors", "errors"),
        ("prompt_tokens_saved", "prompt_tokens_saved"),
    ):
        total = sum(p[point_name] for p in body["points"])
        assert total == sum(r[route_name] for r in report["routes"]) > 0, point_name


async def test_one_step_gives_the_reports_figures(telemetry: Telemetry) -> None:
    """Quantiles, cached share and SLO attainment come from the report's own estimators."""
    now = time.time()
    starts = step_starts(3600, 600, now)
    rng = random.Random(3)
    events = make_events(seed=8, count=400, routes=("openai",), now=now)
    for event in events:
        event.ts = starts[2] + rng.uniform(0, 599)
    await _write(telemetry, events)
    slo = SloConfig(default_ms=300)
    report = (await tenant_report(telemetry.store, "acme", 3600, slo, now))["routes"][0]
    point = (await tenant_series(telemetry.store, "acme", 3600, 600, slo, now))["points"][2]
    assert point["count"] == report["count"] == 400
    for series in ("ttft_ms", "upstream_ttft_ms"):
        assert point[series] == {q: report[series][q] for q in ("p50", "p90", "p99")}
    assert point["gateway_ms"]["p50"] == report["gateway_ms"]["p50"]
    assert point["gateway_ms"]["p99"] == report["gateway_ms"]["p99"]
    assert point["cached_share"] == report["cache_hit_ratio"]
    assert 0 < point["slo_attainment"] < 1
    assert point["slo_attainment"] == pytest.approx(report["slo"]["attainment"], abs=1e-6)
    ttfts = [e.ttft_s for e in events if e.ttft_s is not None]
    gaps = [t - u for t, u in ((e.ttft_s, e.upstream_ttft_s) for e in events) if t and u]
    exact = (sum(gaps) / len(gaps)) / (sum(ttfts) / len(ttfts))
    assert point["gateway_share"] == pytest.approx(exact, abs=1e-6)


def test_window_and_step_bounds() -> None:
    assert series_problem(3600, 60) is None
    assert series_problem(89_940, 60) is None and max_points(89_940, 60) == MAX_POINTS
    param, message = series_problem(90_000, 60) or ("", "")
    assert param == "step" and "1500 points" in message and "1501" in message
    assert series_problem(31 * 86400, 1800) is None
    assert (series_problem(31 * 86400 + 1, 3600) or ("",))[0] == "window"
    assert (series_problem(59, 60) or ("",))[0] == "window"
    for step in (0, 30, 90, 86460):
        assert (series_problem(3600, step) or ("",))[0] == "step", step
    rng = random.Random(1)
    for window, step in ((3600, 60), (3000, 7200), (5000, 600), (600, 3600)):
        lengths = {len(step_starts(window, step, rng.uniform(0, 2e9))) for _ in range(500)}
        assert max(lengths) == max_points(window, step), (window, step)
        assert min(lengths) >= math.ceil(window / step)


async def test_bad_bounds_raise_for_direct_callers() -> None:
    store = MemoryStore(3600)
    with pytest.raises(ValueError, match="1500 points"):
        await tenant_series(store, "acme", 2 * 86400, 60, SloConfig(), time.time())
    with pytest.raises(ValueError, match="unknown api"):
        await tenant_series(store, "acme", 3600, 60, SloConfig(), time.time(), api="x")


# --- hedges ----------------------------------------------------------------------------------


def test_timing_hands_hedged_to_the_event() -> None:
    timing = RequestRecord(tenant="acme", model="m", stream=True)
    assert timing.to_event().hedged is False
    timing.hedged = True
    assert timing.to_event().hedged is True


# --- filters and tenants ---------------------------------------------------------------------


async def test_route_and_api_filters(telemetry: Telemetry) -> None:
    now = time.time()
    ts = now - 120
    events = (
        [_event(ts, route="openai") for _ in range(3)]
        + [_event(ts, route="openai", api="messages")]
        + [_event(ts, route="local", api="messages") for _ in range(2)]
    )
    await _write(telemetry, events)

    async def series(route: str | None = None, api: str | None = None) -> dict:
        return await tenant_series(telemetry.store, "acme", 600, 300, SloConfig(), now, route, api)

    everything = await series()
    assert everything["routes"] == ["openai", "local"]  # busiest first
    assert sum(_by_t(everything).values()) == 6
    local = await series(route="local")
    assert local["route"] == "local" and sum(_by_t(local).values()) == 2
    assert local["routes"] == ["openai", "local"]  # still every route, for the picker
    messages = await series(api="messages")
    assert messages["api"] == "messages" and sum(_by_t(messages).values()) == 3
    assert messages["routes"] == ["local", "openai"]
    both = await series(route="openai", api="messages")
    assert sum(_by_t(both).values()) == 1
    nowhere = await series(route="nope")
    assert sum(_by_t(nowhere).values()) == 0 and nowhere["routes"] == ["openai", "local"]


async def test_tenants_apart_and_summed_by_their_own_slo(telemetry: Telemetry) -> None:
    now = time.time()
    ts = now - 60
    await _write(
        telemetry,
        [_event(ts, tenant="acme", ttft=0.2, prompt=100, cached=0)]
        + [_event(ts, tenant="globex", route="secret", ttft=0.2, prompt=900, cached=900)] * 3,
    )
    slo = SloConfig(default_ms=1000, tenants={"acme": 100})
    acme = await tenant_series(telemetry.store, "acme", 600, 600, slo, now)
    assert acme["slo_ms"] == 100 and acme["routes"] == ["openai"]
    (point,) = [p for p in acme["points"] if p["count"]]
    assert point["count"] == 1 and point["cached_share"] == 0 and point["slo_attainment"] == 0
    everyone = await tenant_series(
        telemetry.store, "*", 600, 600, slo, now, tenants=["acme", "globex"]
    )
    assert everyone["tenant"] == "*" and everyone["slo_ms"] == 1000
    assert everyone["routes"] == ["secret", "openai"]
    (point,) = [p for p in everyone["points"] if p["count"]]
    # acme's one request misses its 100 ms; globex's three meet the default 1000 ms.
    assert point["count"] == 4 and point["slo_attainment"] == 0.75
    assert point["cached_share"] == round(2700 / 2800, 6)
    via_telemetry = await telemetry.series("*", 600, 600)
    assert sum(_by_t(via_telemetry).values()) == 4


# --- Redis: one read per window, writes of one round trip, processes merging ----------------


def _count_executes(client: Any) -> list[int]:
    executes = [0]
    make_pipeline = client.pipeline

    def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a: Any, **k: Any) -> Any:
            executes[0] += 1
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe

    client.pipeline = counting_pipeline
    return executes


async def test_redis_round_trips_and_the_hedged_field(
    redis_url: str, key_prefix: str, sync_redis
) -> None:
    telemetry = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    try:
        assert isinstance(telemetry.store, RedisStore)
        executes = _count_executes(telemetry.store.client)
        now = time.time()
        events = [_event(now - 30, hedged=True), _event(now - 30, api="messages")]
        await _write(telemetry, events)
        assert executes[0] == 1  # the hedged counter rides in the batch's one round trip
        minute = int((now - 30) // 60)
        bucket = KeySpace(key_prefix).bucket("acme", "openai", minute)
        assert int(sync_redis.hget(bucket, "hedged")) == 1
        executes[0] = 0
        body = await tenant_series(telemetry.store, "acme", 3600, 60, SloConfig(), now)
        assert len(body["points"]) == 61 and sum(_by_t(body, "hedges").values()) == 1
        assert executes[0] == 2  # route and API names, then every bucket of the window
    finally:
        await telemetry.aclose()


async def test_two_writers_merge_in_redis(redis_url: str, key_prefix: str) -> None:
    now = time.time()
    a, b = make_events(seed=31, count=700, now=now), make_events(seed=32, count=500, now=now)
    for event in b:
        event.hedged = True
    first = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    second = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
    alone = make_telemetry()
    try:
        for telemetry in (first, second, alone):
            await telemetry.start()
        for x, y in zip(a, b, strict=False):
            first.record(x)
            second.record(y)
        for event in a[len(b) :]:
            first.record(event)
        for event in a + b:
            alone.record(event)
        await asyncio.gather(first.writer.drain(), second.writer.drain(), alone.writer.drain())
        read = [
            await tenant_series(t.store, "acme", 1800, 120, SloConfig(), now)
            for t in (first, second, alone)
        ]
        assert read[0] == read[1]  # either process reads the shared buckets
        for merged, union in zip(read[0]["points"], read[2]["points"], strict=True):
            for name in ("t", "count", "errors", "hedges", "ttft_ms", "upstream_ttft_ms"):
                assert merged[name] == union[name], name
            if union["count"]:
                assert merged["gateway_share"] == pytest.approx(union["gateway_share"], abs=1e-6)
            else:
                assert merged["gateway_share"] is union["gateway_share"] is None
        assert sum(_by_t(read[0]).values()) == 1200
        assert sum(_by_t(read[0], "hedges").values()) == 500
    finally:
        for telemetry in (first, second, alone):
            await telemetry.aclose()


def test_two_real_processes_merge_per_minute(
    redis_url: str, key_prefix: str, subprocess_env: dict
) -> None:
    now = time.time()
    runs = [(41, 1500), (42, 1000)]
    union = write_in_processes(redis_url, key_prefix, subprocess_env, runs, now)

    async def read() -> dict:
        reader = make_telemetry(redis_url, metrics_key_prefix=key_prefix)
        try:
            return await tenant_series(reader.store, "acme", 1800, 60, SloConfig(), now)
        finally:
            await reader.aclose()

    body = asyncio.run(read())
    expected = Counter(int(e.ts // 60) * 60 for e in union)
    assert {t: c for t, c in _by_t(body).items() if c} == dict(expected)
    assert body["routes"] == sorted(
        {"openai", "local"}, key=lambda r: -sum(1 for e in union if e.route == r)
    )


# --- the endpoint ----------------------------------------------------------------------------

KEYS = "acme:key-a,globex:key-b"


class _DownStore(MemoryStore):
    async def read_steps(self, *args: Any) -> Any:
        raise ConnectionError("store down")


async def _endpoint(telemetry: Telemetry) -> httpx.AsyncClient:
    keys = KeyRing(parse_tenant_keys(KEYS), parse_admin_keys("root-key"))
    app = Starlette(routes=metrics_endpoints(admission_for(keys), telemetry, dict))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


@pytest.fixture
async def endpoint(telemetry: Telemetry) -> AsyncIterator[httpx.AsyncClient]:
    ts = time.time() - 60
    await _write(
        telemetry,
        [_event(ts, route="openai"), _event(ts, route="local", api="messages")]
        + [_event(ts, tenant="globex", route="secret", prompt=9000)] * 3,
    )
    async with await _endpoint(telemetry) as client:
        yield client


async def _get(client: httpx.AsyncClient, key: str, **params: str) -> httpx.Response:
    return await client.get(
        "/v1/metrics/ttft/series", params=params, headers={"authorization": f"Bearer {key}"}
    )


async def test_endpoint_serves_a_tenant_its_own_series(endpoint: httpx.AsyncClient) -> None:
    response = await _get(endpoint, "key-a", window="600", step="120")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == BODY_KEYS and body["tenant"] == "acme" and body["slo_ms"] == 1000
    assert (body["window_s"], body["step_s"]) == (600, 120)
    assert body["routes"] == ["local", "openai"] and sum(_by_t(body).values()) == 2
    assert all(p["t"] % 120 == 0 for p in body["points"])
    default = (await _get(endpoint, "key-a")).json()
    assert (default["window_s"], default["step_s"], len(default["points"])) == (3600, 60, 61)
    filtered = (await _get(endpoint, "key-a", route="local", api="messages")).json()
    assert (filtered["route"], filtered["api"]) == ("local", "messages")
    assert sum(_by_t(filtered).values()) == 1
    theirs = (await _get(endpoint, "key-b")).json()
    assert theirs["routes"] == ["secret"] and sum(_by_t(theirs).values()) == 3


async def test_endpoint_keeps_tenants_apart(endpoint: httpx.AsyncClient) -> None:
    for asked in ("globex", "*"):
        denied = await _get(endpoint, "key-a", tenant=asked)
        assert denied.status_code == 403
        assert denied.json()["error"]["code"] == "forbidden_tenant"
    assert (await _get(endpoint, "nope")).status_code == 401
    own = await _get(endpoint, "key-a", tenant="acme")
    assert own.status_code == 200 and sum(_by_t(own.json()).values()) == 2
    globex = (await _get(endpoint, "root-key", tenant="globex")).json()
    assert globex["tenant"] == "globex" and sum(_by_t(globex).values()) == 3
    everyone = (await _get(endpoint, "root-key", tenant="*")).json()
    assert everyone["tenant"] == "*" and sum(_by_t(everyone).values()) == 5
    assert everyone["routes"] == ["secret", "local", "openai"]


@pytest.mark.parametrize(
    ("params", "param", "says"),
    [
        ({"window": "59"}, "window", "60.."),
        ({"window": "abc"}, "window", "seconds"),
        ({"window": str(31 * 86400 + 1)}, "window", "seconds"),
        ({"step": "90"}, "step", "multiple of 60"),
        ({"step": "30"}, "step", "60..86400"),
        ({"step": "86460"}, "step", "60..86400"),
        ({"step": "６０"}, "step", "seconds"),  # noqa: RUF001  # fullwidth digits on purpose
        ({"window": "90000"}, "step", "1500 points"),
        ({"window": str(7 * 86400), "step": "360"}, "step", "1500 points"),
        ({"api": "embeddings"}, "api", "responses"),
        ({"route": ""}, "route", "route name"),
        ({"route": "a\nb"}, "route", "route name"),
        ({"tenant": ""}, "tenant", "tenant name"),
    ],
)
async def test_endpoint_refuses_bad_parameters(
    endpoint: httpx.AsyncClient, params: dict, param: str, says: str
) -> None:
    response = await _get(endpoint, "root-key", **params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"], error["message"]


async def test_endpoint_answers_503_when_the_store_is_down() -> None:
    telemetry = make_telemetry()
    telemetry.store = _DownStore(3600)
    async with await _endpoint(telemetry) as client:
        response = await _get(client, "key-a")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "metrics_store_unavailable"


# --- through a real gateway ------------------------------------------------------------------


def _stream_once(gw, key: str) -> None:
    client = sdk_client(gw, key)
    list(
        client.chat.completions.create(
            model="mock-1", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
    )


def _series(gw, key: str, **params: str) -> httpx.Response:
    return httpx.get(
        gw.url + "/v1/metrics/ttft/series",
        params=params,
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def _wait_for_count(gw, key: str, count: int, **params: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        body = _series(gw, key, **params).json()
        if sum(_by_t(body).values()) >= count or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_gateway_serves_the_series_of_real_requests(mock_upstream, make_gateway) -> None:
    mock_upstream.mock.behaviour.first_delay_s = 0.05
    mock_upstream.mock.behaviour.cached_tokens = 4
    gw = make_gateway(
        [openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key", ttft_slo_ms=2000
    )
    for _ in range(3):
        _stream_once(gw, "key-a")
    body = _wait_for_count(gw, "key-a", 3, window="300")
    assert body["tenant"] == "acme" and body["routes"] == ["mock"] and body["slo_ms"] == 2000
    busy = [p for p in body["points"] if p["count"]]
    assert sum(p["count"] for p in busy) == 3
    for point in busy:
        assert 45 <= point["ttft_ms"]["p50"] <= 1000
        assert point["cached_share"] == 0.4 and point["slo_attainment"] == 1.0
        assert 0 <= point["gateway_share"] < 1
    assert _series(gw, "key-b", tenant="acme").status_code == 403
    assert sum(_by_t(_series(gw, "key-b").json()).values()) == 0
    assert sum(_by_t(_series(gw, "root-key", tenant="acme").json()).values()) == 3


def test_two_gateways_read_one_series_from_redis(
    redis_url, key_prefix, mock_upstream, make_gateway
) -> None:
    common = dict(redis_url=redis_url, metrics_key_prefix=key_prefix, tenant_keys=KEYS)
    one = make_gateway([openai_route(mock_upstream)], **common)
    two = make_gateway([openai_route(mock_upstream)], **common)
    for _ in range(2):
        _stream_once(one, "key-a")
    for _ in range(3):
        _stream_once(two, "key-a")
    assert sum(_by_t(_wait_for_count(one, "key-a", 5)).values()) == 5
    assert sum(_by_t(_wait_for_count(two, "key-a", 5)).values()) == 5


def test_gateway_answers_503_without_its_redis(mock_upstream, make_gateway) -> None:
    gw = make_gateway(
        [openai_route(mock_upstream)],
        tenant_keys=KEYS,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        metrics_key_prefix="fttest-down",
    )
    response = _series(gw, "key-a")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "metrics_store_unavailable"
