"""A request whose prefix its replica is still computing for an earlier request waits for that
request's first token (bounded), then computes only its own part."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from bench.mock_openai import MockUpstream, ThreadedServer
from gateway.upstreams.replicas.prefix_index import prefix_blocks
from gateway.upstreams.replicas.warming import MIN_WAIT_BLOCKS, PrefixWarming
from tests.support.clients import sdk_client
from tests.support.waiting import eventually
from tests.upstreams.replicas.test_fleet_gateway import chat_posts, fleet, fleet_route

BLOCKS = prefix_blocks("s" * 4096)  # 16 blocks
SYSTEM = "You are the support agent of tenant T; answer briefly and politely. " * 30


def run(coroutine_function) -> None:
    asyncio.run(coroutine_function())


def test_a_match_that_ends_in_blocks_being_computed_finds_their_request() -> None:
    async def scenario() -> None:
        warming = PrefixWarming()
        first = warming.start("r0", BLOCKS, matched=4)  # r0 held 4 blocks, computes 12
        assert first is not None and len(warming) == 12
        assert warming.pending("r0", BLOCKS, 16) is first
        assert warming.pending("r0", BLOCKS, 4 + MIN_WAIT_BLOCKS) is first
        # a match that ends in what r0 held before, or takes too little of the new part
        assert warming.pending("r0", BLOCKS, 4) is None
        assert warming.pending("r0", BLOCKS, 4 + MIN_WAIT_BLOCKS - 1) is None
        assert warming.pending("r0", BLOCKS, 1) is None
        assert warming.pending("r1", BLOCKS, 16) is None  # another replica computes nothing
        warming.finish(first)
        assert first.done.done() and len(warming) == 0
        assert warming.pending("r0", BLOCKS, 16) is None
        warming.finish(first)  # idempotent

    run(scenario)


def test_the_first_request_keeps_the_blocks_it_computes() -> None:
    async def scenario() -> None:
        warming = PrefixWarming()
        first = warming.start("r0", BLOCKS[:8], matched=0)
        # a second request sent there before the first token computes only the blocks after
        second = warming.start("r0", BLOCKS, matched=0)
        assert first is not None and second is not None
        assert second.keys == BLOCKS[8:]
        assert warming.pending("r0", BLOCKS, 8) is first
        assert warming.pending("r0", BLOCKS, 16) is second
        assert warming.start("r0", BLOCKS, matched=0) is None  # nothing left to compute
        warming.finish(first)
        assert warming.pending("r0", BLOCKS, 8) is None
        assert warming.pending("r0", BLOCKS, 16) is second
        warming.finish(second)
        assert len(warming) == 0

    run(scenario)


def test_a_wait_ends_with_the_first_token_or_at_its_limit() -> None:
    async def scenario() -> None:
        warming = PrefixWarming()
        computing = warming.start("r0", BLOCKS, matched=0)
        assert computing is not None
        waiter = asyncio.ensure_future(warming.wait(computing, 60.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        warming.finish(computing)
        await asyncio.wait_for(waiter, 5.0)
        # a request whose first token never comes holds a waiter no longer than its limit
        stuck = warming.start("r0", BLOCKS, matched=0)
        assert stuck is not None
        await asyncio.wait_for(warming.wait(stuck, 0.01), 5.0)
        assert not stuck.done.done()
        await warming.wait(stuck, 0.0)  # no time to wait: not counted
        assert warming.waits == 2

    run(scenario)


@pytest.mark.parametrize("balance", ["prefix_affinity", "least_loaded"])
def test_a_conversation_that_starts_while_its_prefix_is_computed_waits_for_it(
    make_gateway, balance
):
    with ThreadedServer(MockUpstream()) as r0, ThreadedServer(MockUpstream()) as r1:
        servers = [r0, r1]
        for server in servers:
            server.mock.behaviour.first_delay_s = 0.5
        gw = make_gateway([fleet_route(servers, balance=balance)])
        # 10 ms a token: a recompute of the system prompt would take seconds, so the wait for
        # the first request's first token (0.5 s) is worth it
        gw.runtime.upstreams["fleet"].balancer.latency.prior_prefill = 10.0
        client = sdk_client(gw)

        def converse(question: str) -> None:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            list(client.chat.completions.create(model="m", messages=messages, stream=True))

        first = threading.Thread(target=converse, args=("my first question",))
        first.start()
        assert eventually(lambda: sum(chat_posts(s) for s in servers) == 1)
        converse("another conversation, the same tenant")
        first.join(10)
        assert not first.is_alive()
        waits = fleet(gw)["prefix_waits"]
        if balance != "prefix_affinity":  # a mode that places by load alone never holds one
            assert waits == {"requests": 0, "waited_ms": 0.0}
            return
        home = next(s for s in servers if chat_posts(s))
        assert chat_posts(home) == 2  # both where the prefix went
        # the second reached the replica only after the first's first token had left it
        second_sent = home.mock.requests[-1]["at"]
        assert second_sent >= home.mock.sent_first[0]
        assert waits["requests"] == 1 and waits["waited_ms"] > 0
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        assert 'firsttoken_prefix_wait_seconds_count{route="fleet"} 1.0' in text
        waited = next(
            line
            for line in text.splitlines()
            if line.startswith("firsttoken_prefix_wait_seconds_sum")
        )
        assert abs(float(waited.split()[-1]) - waits["waited_ms"] / 1000) < 0.001


def test_an_entry_never_reported_ended_stops_holding_anyone_back() -> None:
    async def scenario() -> None:
        warming = PrefixWarming(max_age_s=0.0)
        lost = warming.start("r0", BLOCKS, matched=0)
        assert lost is not None
        await asyncio.sleep(0.001)
        assert warming.pending("r0", BLOCKS, 16) is None
        assert lost.done.done() and len(warming) == 0

    run(scenario)
