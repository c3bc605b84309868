"""Prefix hand-over: a slow replica's warm conversation sends its tenant's shared prefix, once,
to the replica the tenant's next conversation will take."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from bench.mock_openai import MockUpstream, ThreadedServer
from gateway.config.routes import Route
from gateway.upstreams.base import CallContext
from gateway.upstreams.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.upstreams.replicas.hand_over import PER_TARGET, PrefixHandOver, shared_prefix
from gateway.upstreams.replicas.latency import FIXED_SAMPLES
from gateway.upstreams.replicas.prefix_index import PrefixIndex, prefix_blocks, prompt_text
from tests.support.clients import sdk_client
from tests.support.waiting import eventually
from tests.upstreams.replicas.test_fleet_gateway import chat_posts, fleet, fleet_route

PROMPT = prefix_blocks("s" * 4096)  # 16 blocks
MS = {"prior_prefill_ms_per_token": 1.0, "prior_service_ms": 1000.0, "imbalance_abs": 100}
SYSTEM = "You are the support agent of tenant T; answer briefly and politely. " * 30


def replica(name: str, holds: list[bytes] | None = None) -> ReplicaState:
    state = ReplicaState(name=name, index=PrefixIndex())
    if holds:
        state.index.add(holds)
    return state


def slowed_fleet() -> tuple[Balancer, ReplicaState, ReplicaState]:
    """`slow` holds PROMPT and answers 300 ms later than `fast`; conversations of 4 turns."""
    slow, fast = replica("slow", PROMPT), replica("fast")
    b = Balancer([slow, fast], BalanceOptions(**MS))
    for _ in range(FIXED_SAMPLES):
        b.first_token(Choice(slow, 0, 0, "affinity", 0.0), 0.320)
        b.first_token(Choice(fast, 0, 0, "affinity", 0.0), 0.020)
    for i in range(400):
        b.latency.observe_turn(i % 4 == 0)
    return b, slow, fast


def test_a_choice_says_whether_its_replica_was_measured_slow() -> None:
    b, slow, fast = slowed_fleet()
    follow_up = b.choose(PROMPT, 0.0, first_turn=False)
    assert follow_up.replica is slow and follow_up.slow  # a warm conversation stays
    new = b.choose(PROMPT, 0.0, first_turn=True)
    assert new.replica is fast and not new.slow


def test_the_prefix_goes_where_the_next_conversation_would() -> None:
    b, slow, fast = slowed_fleet()
    turns = b.latency.turns_per_session
    assert b.hand_over_target(slow, PROMPT, 4096, 0.0) is fast
    assert b.latency.turns_per_session == turns  # considering counts no turn
    # not once the target holds half of it
    fast.index.add(PROMPT[:8])
    assert b.hand_over_target(slow, PROMPT, 4096, 0.0) is None


def test_no_hand_over_from_a_replica_that_is_not_slow() -> None:
    holder, other = replica("a", PROMPT), replica("b")
    b = Balancer([holder, other], BalanceOptions(**MS))
    for _ in range(FIXED_SAMPLES):
        b.first_token(Choice(holder, 0, 0, "affinity", 0.0), 0.020)
        b.first_token(Choice(other, 0, 0, "affinity", 0.0), 0.021)
    assert not b.choose(PROMPT, 0.0, first_turn=False).slow
    assert b.hand_over_target(holder, PROMPT, 4096, 0.0) is None
    least = Balancer([holder, other], BalanceOptions(mode="least_loaded"))
    assert least.hand_over_target(holder, PROMPT, 4096, 0.0) is None


def test_the_shared_prefix_is_the_tools_and_leading_system_messages() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "developer", "content": "more rules"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "second"},
    ]
    found = shared_prefix({"model": "m", "messages": messages, "tools": tools, "stream": True})
    assert found is not None
    body, chars = found
    assert body == {
        "model": "m",
        "messages": messages[:3],
        "tools": tools,
        "max_tokens": 1,
        "stream": False,
    }
    full = prompt_text({"messages": messages, "tools": tools})
    assert full.startswith(prompt_text({"messages": messages[:2], "tools": tools}))
    assert chars == len(prompt_text({"messages": messages[:2], "tools": tools}))
    # nothing shared, or no user message after it: nothing to hand over
    assert shared_prefix({"messages": messages[2:]}) is None
    assert shared_prefix({"messages": messages[:2]}) is None
    assert shared_prefix({"messages": [messages[0], messages[3]]}) is None
    assert shared_prefix({"prompt": "text"}) is None


def test_the_setting_defaults_to_servers_whose_metrics_are_read() -> None:
    replicas = [{"base_url": "http://127.0.0.1:9/v1"}, {"base_url": "http://127.0.0.1:8/v1"}]
    base = {"name": "f", "models": ["*"], "kind": "openai", "replicas": replicas}
    assert not Route(**base).hands_over_prefixes
    assert Route(**base, load_metrics="vllm").hands_over_prefixes
    assert not Route(**base, load_metrics="vllm", prefix_hand_over=False).hands_over_prefixes
    assert Route(**base, prefix_hand_over=True).hands_over_prefixes
    assert not Route(**base, prefix_hand_over=True, balance="round_robin").hands_over_prefixes
    with pytest.raises(ValidationError, match="prefix_hand_over applies to replicas only"):
        Route(
            name="one",
            models=["*"],
            kind="openai",
            base_url="http://127.0.0.1:9/v1",
            prefix_hand_over=True,
        )


def hand_overs(server: ThreadedServer) -> list[dict]:
    return [
        r["body"]
        for r in server.mock.requests
        if r["path"] == "/v1/chat/completions" and r["body"].get("max_tokens") == 1
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_a_slow_replicas_warm_conversation_hands_its_prefix_over_once(make_gateway, enabled):
    with ExitStack() as stack:
        servers = [stack.enter_context(ThreadedServer(MockUpstream())) for _ in range(2)]
        gw = make_gateway([fleet_route(servers, prefix_hand_over=enabled)])
        client = sdk_client(gw)
        first = {"role": "user", "content": "my first question"}
        messages = [{"role": "system", "content": SYSTEM}, first]
        list(client.chat.completions.create(model="m", messages=messages, stream=True))
        home = next(s for s in servers if chat_posts(s))
        other = next(s for s in servers if s is not home)
        balancer = gw.runtime.upstreams["fleet"].balancer
        home_state, other_state = (balancer.by_name(f"r{servers.index(s)}") for s in (home, other))
        # the home turns 300 ms slower, as the gateway has measured (its answers agree)
        home.mock.behaviour.first_delay_s = 0.3
        for _ in range(FIXED_SAMPLES):
            balancer.first_token(Choice(home_state, 0, 0, "affinity"), 0.32)
            balancer.first_token(Choice(other_state, 0, 0, "affinity"), 0.02)
        for turn in range(3):  # warm follow-ups stay at their home
            messages += [
                {"role": "assistant", "content": "tok0 tok1 tok2 tok3 tok4 "},
                {"role": "user", "content": f"follow-up {turn}"},
            ]
            list(client.chat.completions.create(model="m", messages=messages, stream=True))
        assert chat_posts(home) == 4
        if not enabled:
            assert hand_overs(other) == [] and "hand_overs" not in fleet(gw)
            return
        assert eventually(lambda: hand_overs(other))
        # the first turn's prompt as the home got it (the policies' canonical form), one token
        opened = next(r["body"] for r in home.mock.requests if r["path"].endswith("/completions"))
        assert hand_overs(other) == [
            {"model": "m", "messages": opened["messages"], "max_tokens": 1, "stream": False}
        ]
        assert opened["messages"][1] == first
        counts = {"sent": 1, "failed": 0, "deferred_busy": 0, "deferred_limit": 0}
        assert eventually(lambda: fleet(gw)["hand_overs"] == counts)
        # the tenant's next conversation goes to the new home, which holds its prefix
        again = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "new"}]
        list(client.chat.completions.create(model="m", messages=again, stream=True))
        assert chat_posts(other) == 2 and chat_posts(home) == 4


class FakePool:
    """What `PrefixHandOver` uses of a pool: its balancer, `sent` and `ended`; each member's
    upstream answers a completion once `release` is set."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        self.release = asyncio.Event()
        self.bodies: list[dict] = []
        self.ended_with: list[BaseException | None] = []
        self.members = {
            r.name: SimpleNamespace(state=r, upstream=SimpleNamespace(complete=self._complete))
            for r in balancer.replicas
        }

    async def _complete(self, body: dict, ctx: CallContext) -> None:
        self.bodies.append(body)
        await self.release.wait()

    def sent(self, choice: Choice, blocks: list[bytes], placements: object) -> SimpleNamespace:
        self.balancer.sent(choice, blocks)
        return self.members[choice.replica.name]

    def ended(self, member: SimpleNamespace, failure: BaseException | None, tenant: str) -> None:
        self.balancer.done(member.state)
        self.ended_with.append(failure)


def tenant_request(n: int) -> tuple[dict, list[bytes]]:
    system = {"role": "system", "content": f"Tenant {n}. " + "Rules of the house. " * 60}
    body = {"model": "m", "messages": [system, {"role": "user", "content": "hi"}]}
    return body, prefix_blocks(prompt_text(body))


def test_a_hand_over_waits_for_a_free_slot_and_keeps_to_its_limit() -> None:
    async def scenario() -> None:
        b, slow, fast = slowed_fleet()
        pool = FakePool(b)
        hand_over = PrefixHandOver(pool, "fleet")  # type: ignore[arg-type]
        ctx = CallContext("chat", "t", "m", "req-1")
        requests = [tenant_request(n) for n in range(PER_TARGET + 2)]
        for _, blocks in requests:
            slow.index.add(blocks)
        fast.in_flight = 8  # no slot free: the prefill would queue behind clients' requests
        body, blocks = requests[0]
        hand_over.consider(body, ctx, slow, blocks, 0.0)
        assert hand_over.counts.deferred_busy == 1 and not pool.bodies
        fast.in_flight = 0
        for body, blocks in requests:
            hand_over.consider(body, ctx, slow, blocks, 0.0)
        await asyncio.sleep(0)
        assert hand_over.counts.sent == PER_TARGET and len(pool.bodies) == PER_TARGET
        assert hand_over.counts.deferred_limit == 2
        assert fast.in_flight == PER_TARGET  # each holds a slot while it runs
        assert pool.bodies[0]["max_tokens"] == 1 and pool.bodies[0]["stream"] is False
        # the target holds each prefix sent: it is not sent again
        hand_over.consider(*requests[0][:1], ctx, slow, requests[0][1], 0.0)
        assert hand_over.counts.sent == PER_TARGET and hand_over.counts.deferred_limit == 2
        pool.release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert pool.ended_with == [None] * PER_TARGET and fast.in_flight == 0
        # room again: a deferred prefix goes with the next request that carries it; one
        # cancelled before it ran (the route closing) still gives its slot back
        body, blocks = requests[-1]
        hand_over.consider(body, ctx, slow, blocks, 0.0)
        await hand_over.aclose()
        assert hand_over.counts.sent == PER_TARGET + 1 and fast.in_flight == 0

    asyncio.run(scenario())
