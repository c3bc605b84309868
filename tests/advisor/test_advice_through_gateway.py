"""The cache advisor behind a real gateway: a sloppy client's shuffled tools show up as advice
for its tenant only, and the traffic itself is unchanged."""

from __future__ import annotations

import random

import httpx

from tests.support.clients import sdk_client
from tests.support.gateway import openai_route
from tests.support.waiting import eventually

KEYS = "acme:key-a,globex:key-b"
SYSTEM = "You are the ACME support agent. Answer with care and cite the manual. " * 30


def tool(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up {name} in the ACME systems. " * 5,
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    }


def test_shuffled_tools_become_advice_for_that_tenant_only(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    client = sdk_client(gw, "key-a")
    tools = [tool(f"lookup_{i}") for i in range(12)]
    rng = random.Random(7)
    for turn in range(8):
        rng.shuffle(tools)
        client.chat.completions.create(
            model="gpt-x",
            tools=list(tools),
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"ticket {turn}"},
            ],
        )
    sent = [
        r["body"]["tools"]
        for r in mock_upstream.mock.requests
        if r["path"].endswith("/chat/completions")
    ]
    assert len({tuple(t["function"]["name"] for t in ts) for ts in sent}) > 1  # unchanged order

    def advice(key: str) -> dict:
        return httpx.get(
            gw.url + "/v1/metrics/cache-advice",
            headers={"authorization": f"Bearer {key}"},
            timeout=10,
        ).json()

    def gain() -> float:
        families = advice("key-a").get("families") or []
        gains = [f["variants"]["CANONICALIZE_SORT_TOOLS"]["gain_points"] for f in families]
        return max(gains, default=0.0)

    assert eventually(lambda: gain() > 20, 10.0), advice("key-a")
    assert "FIRSTTOKEN_CANONICALIZE_SORT_TOOLS" in advice("key-a")["summary"]["advice"]
    assert advice("key-b").get("families") == []
    denied = httpx.get(
        gw.url + "/v1/metrics/cache-advice?tenant=acme",
        headers={"authorization": "Bearer key-b"},
        timeout=10,
    )
    assert denied.status_code == 403
