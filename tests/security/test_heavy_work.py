"""Policy work on big bodies leaves the event loop, one job per tenant at a time."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from gateway.boundary.offload import HeavyWork
from tests.security.conftest import TENANT_A_KEY, auth
from tests.support.compiled import patches_policies
from tests.support.gateway import openai_route


async def test_a_tenant_queues_behind_itself_not_behind_others():
    work = HeavyWork(min_bytes=0, workers=2)
    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}

    def job(tenant: str) -> str:
        start = time.perf_counter()
        time.sleep(0.15)  # stands in for CPU work: it holds a worker, not the loop
        spans[tenant].append((start, time.perf_counter()))
        return threading.current_thread().name

    loop_ticks = 0

    async def ticker() -> None:
        nonlocal loop_ticks
        while True:
            await asyncio.sleep(0.01)
            loop_ticks += 1

    tick = asyncio.ensure_future(ticker())
    try:
        names = await asyncio.gather(
            work.run("a", job, "a"), work.run("a", job, "a"), work.run("b", job, "b")
        )
    finally:
        tick.cancel()
        work.close()
    assert all(name.startswith("firsttoken-heavy") for name in names)
    (a1, a2), (b1,) = sorted(spans["a"]), spans["b"]
    assert a2[0] >= a1[1]  # tenant a's second job waited for its first
    assert b1[0] < a1[1] and b1[0] < a2[0]  # tenant b did not wait for tenant a
    assert loop_ticks >= 15  # the loop kept running meanwhile


def test_big_bodies_get_the_same_policies_off_the_loop(
    mock_upstream, make_gateway, tenant_settings
):
    gw = make_gateway(
        [openai_route(mock_upstream)], policy_thread_min_bytes=1024, **tenant_settings
    )
    text = "Some context.   \n\n\n\n\n" + "word " * 400
    body = {
        "model": "mock-a",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}],
    }
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        big = client.post("/v1/chat/completions", json=body, headers=auth(TENANT_A_KEY))
        jobs_after_big = gw.runtime.offload.jobs
        small = client.post(
            "/v1/chat/completions",
            headers=auth(TENANT_A_KEY),
            json={
                "model": "mock-a",
                "messages": [{"role": "user", "content": "hi   \n\n\n\n\nthere"}],
            },
        )
    assert big.status_code == small.status_code == 200
    assert jobs_after_big >= 1 and gw.runtime.offload.jobs == jobs_after_big  # only the big one
    assert big.headers["x-firsttoken-policies"] == small.headers["x-firsttoken-policies"]
    assert int(big.headers["x-firsttoken-prompt-tokens-saved"]) >= 1
    sent = [r["body"] for r in mock_upstream.mock.requests]
    assert "\n\n\n\n" not in sent[0]["messages"][0]["content"]  # slimmed in the worker
    assert sent[0]["prompt_cache_key"].startswith("ft-")  # cache hints applied too


@patches_policies
async def test_a_tokenizer_panic_degrades_the_report_not_the_request(monkeypatch):
    from gateway.pipeline.policies import report_headers
    from policies import DEFAULT_POLICIES, PolicyContext, build_chain

    class PanicException(BaseException):  # what pyo3 raises; not an Exception
        pass

    class Telemetry:
        enabled = False

    result = build_chain(tuple(DEFAULT_POLICIES), {}).transform(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        PolicyContext(endpoint="chat", route_kind="openai", model="m", tenant="t"),
    )

    def raising(exc: BaseException):
        def measure(**_):
            raise exc

        return measure

    monkeypatch.setattr(result, "measure", raising(PanicException("tokenizer panicked")))
    assert await report_headers(Telemetry(), "t", result) == {}
    monkeypatch.setattr(result, "measure", raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # control flow is never swallowed
        await report_headers(Telemetry(), "t", result)


def test_a_new_long_prompt_is_counted_off_the_loop_and_only_the_first_time(
    mock_upstream, make_gateway, tenant_settings
):
    gw = make_gateway([openai_route(mock_upstream)], **tenant_settings)  # 64 KiB threshold
    system = " ".join(f"clause-{uuid.uuid4().hex[:8]} applies." for _ in range(600))
    assert 8_000 < len(system) < 64 * 1024  # long, yet a small body

    def turn(question: str) -> httpx.Response:
        body = {
            "model": "mock-a",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        }
        return client.post("/v1/chat/completions", json=body, headers=auth(TENANT_A_KEY))

    with httpx.Client(base_url=gw.url, timeout=30) as client:
        jobs = gw.runtime.offload.jobs
        first = turn("what applies?")
        jobs_after_first = gw.runtime.offload.jobs
        second = turn("and what else?")
    assert first.status_code == second.status_code == 200
    assert jobs_after_first > jobs  # its count went to a heavy-work thread
    assert gw.runtime.offload.jobs == jobs_after_first  # counted once: the next turn stays inline
    assert "x-firsttoken-prompt-tokens-saved" in first.headers
    assert "x-firsttoken-prompt-tokens-saved" in second.headers
