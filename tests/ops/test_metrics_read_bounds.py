"""A metrics read is bounded by what the store keeps and by a budget per tenant: a 31-day window
reads 7 days of metrics (a day of advice), the answer says so in `window_s`, and a tenant's
reads queue behind each other (one at a time per tenant, the gateway MAX_CONCURRENT_READS) rather
than pile onto the loop."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.errors import GatewayError
from gateway.ops.metrics import MAX_WAITING_READS, ReadBudget
from tests.security.conftest import TENANT_A_KEY, TENANT_KEYS, auth
from tests.support.gateway import openai_route

MONTH = str(31 * 86400)


@pytest.fixture
def tenant_settings() -> dict:
    return {"tenant_keys": TENANT_KEYS}


def test_the_longest_windows_read_only_what_is_retained(
    make_gateway, mock_upstream, tenant_settings
):
    gw = make_gateway([openai_route(mock_upstream)], **tenant_settings)
    store = gw.runtime.telemetry.store
    minutes: list[int] = []
    original = store.read_split

    async def counted(tenant, first, last):
        minutes.append(last - first + 1)
        return await original(tenant, first, last)

    store.read_split = counted
    with httpx.Client(base_url=gw.url, headers=auth(TENANT_A_KEY), timeout=30) as client:
        ttft = client.get("/v1/metrics/ttft", params={"window": MONTH})
        assert ttft.status_code == 200 and ttft.json()["window_s"] == 7 * 86400
        assert minutes and max(minutes) <= 7 * 1440 + 1
        series = client.get("/v1/metrics/ttft/series", params={"window": MONTH, "step": "3600"})
        assert series.status_code == 200 and series.json()["window_s"] == 7 * 86400
        advice = client.get("/v1/metrics/cache-advice", params={"window": MONTH})
        assert advice.status_code == 200 and advice.json()["window_s"] == 86400
        over = client.get("/v1/metrics/ttft", params={"window": str(31 * 86400 + 1)})
        assert over.status_code == 400 and over.json()["error"]["param"] == "window"


def test_a_shorter_retention_clamps_shorter(make_gateway, mock_upstream, tenant_settings):
    gw = make_gateway([openai_route(mock_upstream)], metrics_retention=3600, **tenant_settings)
    r = httpx.get(gw.url + "/v1/metrics/ttft", params={"window": MONTH}, headers=auth(TENANT_A_KEY))
    assert r.status_code == 200 and r.json()["window_s"] == 3600


def test_the_budget_runs_one_read_per_tenant_and_refuses_a_pile():
    async def main() -> None:
        budget = ReadBudget(concurrent=2)
        running: list[str] = []
        peak = {"acme": 0, "all": 0}
        release = asyncio.Event()

        async def read(tenant: str) -> None:
            async with budget.hold(tenant):
                running.append(tenant)
                peak["acme"] = max(peak["acme"], running.count("acme"))
                peak["all"] = max(peak["all"], len(running))
                await release.wait()
                running.remove(tenant)

        reads = [asyncio.create_task(read("acme")) for _ in range(MAX_WAITING_READS + 1)]
        others = [asyncio.create_task(read(t)) for t in ("globex", "initech")]
        for _ in range(20):
            await asyncio.sleep(0)
        assert running.count("acme") == 1  # the rest of acme's reads wait behind its first
        assert len(running) == 2  # and the gateway runs two reads at most
        with pytest.raises(GatewayError) as refused:
            async with budget.hold("acme"):
                pass
        assert refused.value.status == 429
        release.set()
        await asyncio.gather(*reads, *others)
        assert peak == {"acme": 1, "all": 2}
        assert not budget._tenants and not budget._waiting  # nothing kept once idle

    asyncio.run(main())
