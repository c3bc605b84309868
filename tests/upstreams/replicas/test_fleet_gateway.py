"""Replicated routes through the gateway, against real loopback servers: prefix affinity keeps a
conversation on one replica, a replica that stops is ejected and comes back when it returns, a
slow first token is hedged (the loser's connection closes), and the hedge budget holds."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack

import httpx
import pytest

from bench.mock_openai import MockUpstream, ThreadedServer
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV
from tests.support.waiting import eventually

SYSTEM = "You are a support agent for ACME. " * 40


@pytest.fixture
def servers():
    """Three mock OpenAI servers on loopback; each test scripts their behaviour."""
    with ExitStack() as stack:
        yield [stack.enter_context(ThreadedServer(MockUpstream())) for _ in range(3)]


def fleet_route(servers, **extra) -> dict:
    return {
        "name": "fleet",
        "models": ["*"],
        "kind": "openai",
        "api_key_env": UPSTREAM_KEY_ENV,
        "replicas": [
            {"name": f"r{i}", "base_url": server.base_url} for i, server in enumerate(servers)
        ],
        **extra,
    }


def chat_posts(server) -> int:
    return sum(1 for r in server.mock.requests if r["path"] == "/v1/chat/completions")


def ask(client, system: str, turns: list[str]) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        list(client.chat.completions.create(model="m", messages=messages, stream=True))
        messages.append({"role": "assistant", "content": "tok0 tok1 tok2 tok3 tok4 "})


def fleet(gw) -> dict:
    """The fleet's figures, as an operator reads them (open gateway: no key needed)."""
    return httpx.get(gw.url + "/v1/metrics/ttft", timeout=10).json()["replicas"]["fleet"]


def replica_states(gw) -> dict[str, dict]:
    return {r["name"]: r for r in fleet(gw)["replicas"]}


def test_prefix_affinity_keeps_each_conversation_on_one_replica(servers, make_gateway):
    gw = make_gateway([fleet_route(servers)])
    client = sdk_client(gw)
    for n in range(6):
        before = [chat_posts(s) for s in servers]
        ask(client, f"Agent {n}. " + SYSTEM, [f"question {i} of session {n}" for i in range(4)])
        grew = [chat_posts(s) - b for s, b in zip(servers, before, strict=True)]
        assert sorted(grew) == [0, 0, 4], grew  # all four turns on one replica
    states = replica_states(gw)
    assert sum(r["affinity_hits"] for r in states.values()) >= 6 * 3
    assert sum(1 for s in servers if chat_posts(s)) >= 2  # sessions spread over replicas


def test_round_robin_and_least_loaded_spread_requests(servers, make_gateway):
    for mode in ("round_robin", "least_loaded"):
        gw = make_gateway([fleet_route(servers, balance=mode)])
        before = [chat_posts(s) for s in servers]
        client = sdk_client(gw)
        for _ in range(9):
            ask(client, SYSTEM, ["same question"])
        grew = [chat_posts(s) - b for s, b in zip(servers, before, strict=True)]
        assert sum(grew) == 9 and min(grew) >= 2, (mode, grew)


def test_a_stopped_replica_is_ejected_and_a_probe_brings_it_back(servers, make_gateway):
    leaving = ThreadedServer(MockUpstream()).__enter__()
    fleet = [servers[0], leaving, servers[2]]
    route = fleet_route(fleet, probe_interval_s=0.2, eject_s=30, balance="round_robin")
    gw = make_gateway([route])
    client = sdk_client(gw)
    port = leaving.port
    leaving.__exit__(None, None, None)  # r1 goes away
    for i in range(6):  # every request succeeds: the proxy's retry goes to another replica
        ask(client, SYSTEM, [f"q{i}"])
    states = replica_states(gw)
    assert states["r1"]["state"] == "ejected" and states["r1"]["ejections"] >= 1
    assert states["r0"]["state"] == states["r2"]["state"] == "healthy"
    ready = httpx.get(gw.url + "/readyz", timeout=10).json()
    assert ready["replicas"] == {"fleet": {"r0": "healthy", "r1": "ejected", "r2": "healthy"}}
    with ThreadedServer(MockUpstream(), port=port) as back:
        assert eventually(lambda: replica_states(gw)["r1"]["state"] == "healthy", 5.0)
        for i in range(3):
            ask(client, SYSTEM, [f"again {i}"])
        assert chat_posts(back) >= 1


def test_a_slow_first_token_is_hedged_and_the_loser_closed(servers, make_gateway):
    slow, fast = servers[0], servers[1]
    slow.mock.behaviour.first_delay_s = 3.0
    route = fleet_route(servers[:2], hedge_after_ms=150, hedge_max_ratio=1.0, balance="round_robin")
    gw = make_gateway([route])
    client = sdk_client(gw)
    for i in range(4):  # round robin: two of them start on the slow replica
        ask(client, SYSTEM, [f"q{i}"])
    hedges = fleet(gw)["hedges"]
    assert hedges["sent"] == 2 and hedges["won"] == 2 and hedges["lost"] == 0
    # The losers were closed: the slow replica finds its clients gone when its 3 s are up (it
    # notices on its first write). And it never sent a first token: no request waited for it.
    assert eventually(lambda: len(slow.mock.disconnects) >= 2, 10.0)
    assert slow.mock.sent_first == []
    assert chat_posts(fast) == 4


def test_no_hedge_when_the_first_token_is_fast(servers, make_gateway):
    gw = make_gateway([fleet_route(servers, hedge_after_ms=500, hedge_max_ratio=1.0)])
    client = sdk_client(gw)
    for i in range(5):
        ask(client, SYSTEM, [f"q{i}"])
    hedges = fleet(gw)["hedges"]
    assert hedges == {"sent": 0, "won": 0, "lost": 0}
    assert sum(chat_posts(s) for s in servers) == 5  # one upstream request each


def test_the_hedge_budget_holds_when_every_replica_is_slow(servers, make_gateway):
    for server in servers:
        server.mock.behaviour.first_delay_s = 0.3
    route = fleet_route(servers, hedge_after_ms=50, hedge_max_ratio=0.25)
    gw = make_gateway([route])
    client = sdk_client(gw)
    for i in range(12):
        ask(client, SYSTEM, [f"q{i}"])
    hedges = fleet(gw)["hedges"]
    assert 1 <= hedges["sent"] <= 0.25 * 12
    assert sum(chat_posts(s) for s in servers) == 12 + hedges["sent"]


def test_store_true_is_never_hedged(servers, make_gateway):
    servers[0].mock.behaviour.first_delay_s = 0.6
    servers[1].mock.behaviour.first_delay_s = 0.6
    route = fleet_route(servers[:2], hedge_after_ms=50, hedge_max_ratio=1.0)
    gw = make_gateway([route])
    list(
        sdk_client(gw).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True, store=True
        )
    )
    hedges = fleet(gw)["hedges"]
    assert hedges["sent"] == 0


def test_replica_metrics_in_prometheus(servers, make_gateway):
    gw = make_gateway([fleet_route(servers)])
    ask(sdk_client(gw), SYSTEM, ["a", "b"])
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'firsttoken_replica_healthy{replica="r0",route="fleet"} 1.0' in text
    assert "firsttoken_replica_affinity_hits_total" in text
    counts = Counter(
        line.split("}")[0]
        for line in text.splitlines()
        if line.startswith("firsttoken_replica_requests_total")
    )
    assert len(counts) == 3
    assert servers[0].base_url not in text  # names, never URLs


def test_replica_configuration_is_checked(servers):
    from gateway.config.settings import SettingsError, load_settings

    bad = [
        {**fleet_route(servers), "kind": "anthropic"},
        {**fleet_route(servers), "base_url": servers[0].base_url},
        {**fleet_route(servers), "replicas": [{"base_url": "ftp://x"}]},
        {**fleet_route(servers), "balance": "random"},
        {**fleet_route(servers), "hedge_after_ms": 0},
        {**fleet_route(servers), "replicas": [{"name": "a", "base_url": servers[0].base_url}] * 2},
    ]
    for route in bad:
        with pytest.raises(SettingsError):
            load_settings(environ={}, routes=[route])


def test_a_replica_that_misses_the_first_token_timeout_is_ejected(servers, make_gateway):
    servers[0].mock.behaviour.first_delay_s = 2.0
    route = fleet_route(servers[:2], balance="round_robin", first_token_timeout_s=0.3, eject_s=30)
    gw = make_gateway([route])
    client = sdk_client(gw)
    for i in range(4):  # the proxy retries the slow replica's requests on the other one
        ask(client, SYSTEM, [f"q{i}"])
    states = replica_states(gw)
    assert states["r0"]["state"] == "ejected" and states["r1"]["state"] == "healthy"
    assert chat_posts(servers[0]) == 1  # ejected after its first miss: never tried again


def test_hedged_requests_are_counted_in_the_tenant_series(servers, make_gateway):
    servers[0].mock.behaviour.first_delay_s = 2.0
    route = fleet_route(servers[:2], hedge_after_ms=100, hedge_max_ratio=1.0, balance="round_robin")
    gw = make_gateway([route])
    client = sdk_client(gw)
    for i in range(4):
        ask(client, SYSTEM, [f"q{i}"])

    def hedged() -> int:
        series = httpx.get(gw.url + "/v1/metrics/ttft/series?window=600", timeout=10).json()
        return sum(point["hedges"] for point in series["points"])

    assert eventually(lambda: hedged() == 2, 5.0)


def test_a_tenants_own_errors_eject_no_replica(servers, make_gateway):
    """400s and 500s that only one tenant's requests draw (a validation error some servers
    report as a 500) are that tenant's: every replica stays healthy for the others."""
    for server in servers[:2]:
        server.mock.behaviour.fail_statuses = [400, 400, 500, 500, 500, 500]
    gw = make_gateway([fleet_route(servers[:2], eject_s=30)])
    client = httpx.Client(base_url=gw.url, timeout=10)
    body = {"model": "m", "messages": [{"role": "user", "content": "bad"}], "stream": True}
    statuses = [client.post("/v1/chat/completions", json=body).status_code for _ in range(6)]
    assert 400 in statuses and any(s >= 500 for s in statuses)  # (a retry may have answered)
    for server in servers[:2]:
        server.mock.behaviour.fail_statuses = []
    states = replica_states(gw)
    assert {r["state"] for r in states.values()} == {"healthy"}, states
    assert sum(r["ejections"] for r in states.values()) == 0
    ready = httpx.get(gw.url + "/readyz", timeout=10).json()
    assert ready["replicas"] == {"fleet": {"r0": "healthy", "r1": "healthy"}}
    ask(sdk_client(gw), SYSTEM, ["a good question", "and another"])
