"""The cache advisor: variants, accounting, storage bounds, the endpoint, and that it only
observes (a failing advisor never fails a request)."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from gateway.advisor import (
    ALL_OPT_INS,
    OPT_INS,
    CacheAdvisor,
    advisor_for,
    bucket_of,
    observe_cache_advice,
    tenant_advice,
)
from gateway.boundary.admit import Admission
from gateway.boundary.auth import KeyRing
from gateway.config.routes import RouteTable
from gateway.config.settings import load_settings
from gateway.ops.advice import advice_endpoints
from gateway.pipeline.policies import report_headers
from gateway.telemetry.store import ADVICE_FAMILIES_PER_TENANT, MemoryStore
from gateway.telemetry.telemetry import Telemetry
from gateway.upstreams.registry import Upstreams
from policies import DEFAULT_POLICIES, PolicyContext, build_chain


def _tool(name: str) -> dict:
    words = " ".join(f"{name}-word{i}" for i in range(60))
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": words,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }


SYSTEM = " ".join(f"rule{i} applies to every answer." for i in range(400))


def _body(rng: random.Random, turn: int, shuffle_tools: bool) -> dict:
    tools = [_tool(f"tool_{i}") for i in range(10)]
    if shuffle_tools:
        rng.shuffle(tools)
    history = []
    for i in range(turn):
        history += [
            {"role": "user", "content": f"question {i} " + "detail " * 80},
            {"role": "assistant", "content": f"answer {i} " + "because " * 80},
        ]
    messages = [{"role": "system", "content": SYSTEM}, *history]
    return {
        "model": "gpt-4.1",
        "messages": [*messages, {"role": "user", "content": "next?"}],
        "tools": tools,
    }


def _telemetry() -> Telemetry:
    settings = load_settings(environ={})
    return Telemetry(MemoryStore(settings.metrics_retention), settings)


async def _replay(telemetry: Telemetry, tenant: str, bodies: list[dict]) -> None:
    advisor = advisor_for(telemetry)
    advisor.max_per_s = advisor.burst = 1e9
    advisor.cpu_share = 1.0
    chain = build_chain(DEFAULT_POLICIES, {})
    for body in bodies:
        ctx = PolicyContext("chat", "openai", "gpt-4.1", tenant)
        await report_headers(telemetry, tenant, chain.transform(body, ctx))
        while advisor._tasks:
            await asyncio.gather(*advisor._tasks)
        await telemetry.writer.drain()


async def _advice(telemetry: Telemetry, tenant: str) -> dict:
    now = bucket_of(__import__("time").time())
    return tenant_advice(tenant, await telemetry.read_advice(tenant, now - 1, now), 3600)


async def test_shuffled_tools_show_a_gain_for_sort_tools_only():
    telemetry, rng = _telemetry(), random.Random(1)
    await _replay(telemetry, "t", [_body(rng, turn, shuffle_tools=True) for turn in range(8)])
    answer = await _advice(telemetry, "t")
    [family] = answer["families"]
    assert family["requests"] == 8
    assert family["observed_cached_share"] < 0.05
    gains = {name: figures["gain_points"] for name, figures in family["variants"].items()}
    assert gains["CANONICALIZE_SORT_TOOLS"] > 50
    assert gains[ALL_OPT_INS] > 50
    for name in OPT_INS:
        if name != "CANONICALIZE_SORT_TOOLS":
            assert gains[name] == pytest.approx(0, abs=0.5), name
    # Breaks are counted for the tenant (every request, as the header names them): 7 of 8.
    assert answer["summary"]["break_kinds"] == {"tools(order)": 7}
    assert family["advice"].startswith("turn on FIRSTTOKEN_CANONICALIZE_SORT_TOOLS: +")
    assert family["variants"]["CANONICALIZE_SORT_TOOLS"]["est_cost_saved_per_day_usd"] > 0
    assert family["variants"]["CANONICALIZE_SORT_TOOLS"]["est_ttft_saved_ms"] > 0


async def test_a_clean_family_shows_no_gain():
    telemetry, rng = _telemetry(), random.Random(1)
    await _replay(telemetry, "t", [_body(rng, turn, shuffle_tools=False) for turn in range(8)])
    answer = await _advice(telemetry, "t")
    [family] = answer["families"]
    assert family["observed_cached_share"] > 0.6
    for figures in family["variants"].values():
        assert figures["gain_points"] == pytest.approx(0, abs=0.5)
    assert answer["summary"]["break_kinds"] == {}
    assert family["advice"] == "no opt-in would raise the cached share"


async def test_families_per_tenant_are_capped_least_recent_first():
    store = MemoryStore(86400)
    bucket = bucket_of(__import__("time").time())
    for index in range(ADVICE_FAMILIES_PER_TENANT + 5):
        await store.write_advice({("t", f"fam-{index}", bucket): {"requests": 1}})
    await store.write_advice({("other", "fam-0", bucket): {"requests": 1}})
    kept = await store.read_advice("t", bucket, bucket)
    assert len(kept) == ADVICE_FAMILIES_PER_TENANT
    assert "fam-0" not in kept and f"fam-{ADVICE_FAMILIES_PER_TENANT + 4}" in kept
    assert await store.read_advice("other", bucket, bucket) == {"fam-0": {"requests": 1}}


async def test_a_failing_advisor_never_fails_the_report(monkeypatch):
    from gateway.pipeline.policies import report_headers

    telemetry = _telemetry()

    def broken(*_args, **_kwargs):
        raise RuntimeError("advisor broke")

    monkeypatch.setattr(CacheAdvisor, "observe", broken)
    ctx = PolicyContext("chat", "openai", "gpt-4.1", "t")
    result = build_chain(DEFAULT_POLICIES, {}).transform(_body(random.Random(1), 2, True), ctx)
    headers = await report_headers(telemetry, "t", result)
    assert "x-firsttoken-prompt-tokens-saved" in headers
    # And a failure inside the shadow task is counted, not raised.
    monkeypatch.undo()
    advisor = advisor_for(telemetry)
    monkeypatch.setattr(advisor.chains, "fingerprints", broken)
    result = build_chain(DEFAULT_POLICIES, {}).transform(_body(random.Random(2), 2, True), ctx)
    await report_headers(telemetry, "t", result)
    while advisor._tasks:
        await asyncio.gather(*advisor._tasks)
    assert advisor.failed == 1 and advisor.evaluated == 0


async def test_the_advisor_keeps_to_its_share_of_the_process_cpu():
    import time

    telemetry = _telemetry()
    advisor = advisor_for(telemetry)
    advisor.max_per_s = advisor.burst = 1e9  # only the CPU budget samples
    # A budget that binds on any machine: a share and a start-up bucket far below what one
    # evaluation costs (with the defaults, a fast machine evaluated all 60 turns within them).
    advisor.cpu_share = 0.001
    advisor._cpu_budget = start_budget = 1e-6
    chain = build_chain(DEFAULT_POLICIES, {})
    ctx = PolicyContext("chat", "openai", "gpt-4.1", "t")
    rng = random.Random(3)
    started = time.process_time()
    for turn in range(60):
        result = chain.transform(_body(rng, turn % 12, shuffle_tools=True), ctx).measure()
        observe_cache_advice(telemetry, "t", result)
        while advisor._tasks:
            await asyncio.gather(*advisor._tasks)
    total = time.process_time() - started
    assert advisor.evaluated > 0 and advisor.skipped > 0
    # What it may have spent: its share of all the CPU, its start-up burst, and the one
    # evaluation admitted last (charged after it ran).
    largest = advisor.cpu_spent_s / advisor.evaluated * 4
    assert advisor.cpu_spent_s <= advisor.cpu_share * total + start_budget + largest


async def test_work_off_the_loop_is_charged_all_of_its_threads_cpu():
    """The hop to the advisor's thread costs CPU too (the thread's start, its wake-ups): the
    budget is charged the thread's whole CPU time, not only the work's."""
    import threading
    import time

    advisor = advisor_for(_telemetry())

    def spin(seconds: float) -> int:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return threading.get_ident()

    threads = {await advisor._off_loop(spin, 0.005) for _ in range(3)}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert advisor.cpu_spent_s >= 0.015
    # The thread's CPU clock at the end of its last job: all of it has been charged (and only
    # the return from that job besides).
    clock = await advisor._off_loop(time.thread_time)
    assert clock <= advisor.cpu_spent_s <= clock + 0.01


def _advice_routes(telemetry: Telemetry, keys: KeyRing) -> list:
    settings = load_settings(environ={})
    admission = Admission(settings, keys, Upstreams(RouteTable([]), settings))
    return advice_endpoints(admission, telemetry, settings.policy_options)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def test_endpoint_shows_a_tenant_only_its_own_families():
    telemetry, rng = _telemetry(), random.Random(1)

    async def record() -> None:
        await _replay(telemetry, "alice", [_body(rng, t, True) for t in range(3)])
        await _replay(telemetry, "bob", [_body(rng, t, False) for t in range(3)])

    asyncio.run(record())
    keys = KeyRing({_digest("ka"): "alice", _digest("kb"): "bob"}, frozenset({_digest("adm")}))
    app = Starlette(routes=_advice_routes(telemetry, keys))
    with TestClient(app) as client:
        url = "/v1/metrics/cache-advice"
        alice = client.get(url, headers={"authorization": "Bearer ka"})
        assert alice.status_code == 200
        assert alice.json()["tenant"] == "alice"
        bob_families = client.get(url, headers={"authorization": "Bearer kb"}).json()["families"]
        alice_families = {f["family"] for f in alice.json()["families"]}
        assert alice_families and not alice_families & {f["family"] for f in bob_families}
        denied = client.get(url + "?tenant=bob", headers={"authorization": "Bearer ka"})
        assert denied.status_code == 403
        assert client.get(url, headers={"authorization": "Bearer nope"}).status_code == 401
        admin = client.get(url + "?tenant=bob", headers={"authorization": "Bearer adm"})
        assert admin.json()["tenant"] == "bob"
        assert (
            client.get(url + "?window=0", headers={"authorization": "Bearer ka"}).status_code == 400
        )


async def test_redis_store_keeps_advice_across_processes_and_caps_families(redis_url, key_prefix):
    from gateway.telemetry.keys import KeySpace
    from gateway.telemetry.redis_store import RedisStore, connect

    stores = [RedisStore(connect(redis_url), KeySpace(key_prefix), 86400) for _ in range(2)]
    bucket = bucket_of(__import__("time").time())
    try:
        for store in stores:  # two gateway processes add to the same family
            await store.write_advice({("t", "fam", bucket): {"requests": 2, "cached:x": 5}})
        for index in range(ADVICE_FAMILIES_PER_TENANT + 3):
            await stores[0].write_advice({("t", f"more-{index}", bucket + 1): {"requests": 1}})
        read = await stores[1].read_advice("t", bucket, bucket + 1)
        assert len(read) == ADVICE_FAMILIES_PER_TENANT
        assert "fam" not in read  # the least recent family left the index
        # Back in the index once recent again; its older bucket is still read (until it expires).
        await stores[0].write_advice({("t", "fam", bucket + 2): {"requests": 2, "cached:x": 5}})
        read = await stores[1].read_advice("t", bucket, bucket + 2)
        assert read["fam"] == {"requests": 6, "cached:x": 15}
        assert await stores[1].read_advice("other", bucket, bucket + 1) == {}
    finally:
        for store in stores:
            await store.aclose()


async def test_the_process_clock_is_read_only_for_a_request_the_rate_would_admit(monkeypatch):
    # Reading the process's CPU clock on every request was a cost of its own on a busy loop:
    # a request the rate limit turns away must not read it.
    import gateway.advisor.shadow as shadow

    telemetry = _telemetry()
    advisor = advisor_for(telemetry)
    advisor.max_per_s, advisor.burst = 1e-9, 1.0  # one evaluation, then none for ages
    readings = []
    real = shadow.time.process_time
    monkeypatch.setattr(shadow.time, "process_time", lambda: readings.append(1) or real())
    chain = build_chain(DEFAULT_POLICIES, {})
    ctx = PolicyContext("chat", "openai", "gpt-4.1", "t")
    rng = random.Random(5)
    for turn in range(10):
        result = chain.transform(_body(rng, turn, shuffle_tools=False), ctx).measure()
        observe_cache_advice(telemetry, "t", result)
        while advisor._tasks:
            await asyncio.gather(*advisor._tasks)
    assert advisor.evaluated == 1 and advisor.skipped == 9
    assert len(readings) == 1
