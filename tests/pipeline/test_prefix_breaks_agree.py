"""The prefix-break header, `firsttoken_prefix_breaks_total` and the cache advice (the
dashboard's table) count the same events: none for new questions after an unchanged prefix,
one per changed block class when the clock in the system prompt and the tools' order move."""

from __future__ import annotations

import re

import httpx

from tests.support.gateway import openai_route
from tests.support.waiting import eventually

KEY = "acme:key-a"
RULES = "Answer with care and cite the manual. " * 60
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"lookup_{i}",
            "description": f"Look up record {i}. " * 5,
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    }
    for i in range(4)
]


def system(clock: str) -> str:
    return RULES[:600] + f"Now: {clock}. " + RULES[600:]


def ask(gw, question: str, clock: str = "10:00:00", tools=TOOLS) -> httpx.Response:
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=20,
        headers={"authorization": "Bearer key-a"},
        json={
            "model": "mock-1",
            "tools": tools,
            "messages": [
                {"role": "system", "content": system(clock)},
                {"role": "user", "content": question},
            ],
        },
    )
    assert response.status_code == 200
    return response


def prometheus_breaks(gw) -> dict[str, float]:
    admin = {"authorization": "Bearer admin-key"}
    text = httpx.get(gw.url + "/metrics", headers=admin, timeout=10).text
    assert "firsttoken_prefix_breaks_total" in text
    found = {}
    for line in text.splitlines():
        if line.startswith("firsttoken_prefix_breaks_total{"):
            kind = re.search(r'kind="([^"]+)"', line).group(1)
            found[kind] = float(line.rsplit(" ", 1)[1])
    return found


def advice_breaks(gw) -> dict[str, int]:
    answer = httpx.get(
        gw.url + "/v1/metrics/cache-advice",
        headers={"authorization": "Bearer key-a"},
        timeout=10,
    ).json()
    return answer["summary"]["break_kinds"]


def test_header_prometheus_and_advice_count_the_same_breaks(mock_upstream, make_gateway):
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEY, admin_keys="admin-key")
    headers = [ask(gw, f"question {n}").headers for n in range(4)]
    # New questions after an unchanged prefix: no break anywhere.
    assert all("x-firsttoken-prefix-break" not in h for h in headers), headers
    assert all(int(h["x-firsttoken-prefix-stable-tokens"]) > 300 for h in headers[1:])
    assert prometheus_breaks(gw) == {}

    clock = ask(gw, "question 4", clock="10:05:00").headers["x-firsttoken-prefix-break"]
    assert re.fullmatch(r"messages\[0\]@char \d+", clock), clock
    both = ask(gw, "question 5", clock="10:07:30", tools=TOOLS[::-1])
    named = both.headers["x-firsttoken-prefix-break"].split(", ")
    assert named[0] == "tools(order)" and named[1].startswith("messages[0]@char "), named

    assert prometheus_breaks(gw) == {"system": 2.0, "tools": 1.0}
    expected = {"system": 2, "tools(order)": 1}
    assert eventually(lambda: advice_breaks(gw) == expected, 10.0), advice_breaks(gw)
