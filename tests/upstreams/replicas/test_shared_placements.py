"""Two gateway processes (two gateways here) share where prefixes live through Redis Pub/Sub,
and a placement message from Redis is untrusted input."""

from __future__ import annotations

from contextlib import ExitStack

import orjson
import pytest

from bench.mock_openai import MockUpstream, ThreadedServer
from gateway.upstreams.replicas.prefix_index import prefix_blocks, prompt_text
from gateway.upstreams.replicas.shared_index import SharedPlacements
from tests.support.clients import sdk_client
from tests.support.waiting import eventually
from tests.upstreams.replicas.test_fleet_gateway import SYSTEM, fleet_route


@pytest.fixture
def servers():
    with ExitStack() as stack:
        yield [stack.enter_context(ThreadedServer(MockUpstream())) for _ in range(3)]


def test_a_placement_on_one_gateway_reaches_the_other(servers, key_prefix, redis_url, make_gateway):
    common = {"redis_url": redis_url, "metrics_key_prefix": key_prefix}
    one = make_gateway([fleet_route(servers)], **common)
    two = make_gateway([fleet_route(servers)], **common)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    list(sdk_client(one).chat.completions.create(model="m", messages=messages, stream=True))
    blocks = prefix_blocks(prompt_text({"messages": messages}), "default")
    used = [
        name
        for name, member in one.runtime.fleets["fleet"].members.items()
        if member.state.index.matched(blocks) == len(blocks)
    ]
    assert len(used) == 1
    learned = two.runtime.fleets["fleet"].members[used[0]].state.index
    assert eventually(lambda: learned.matched(blocks) == len(blocks), 5.0)
    assert two.runtime.placements.applied >= 1
    others = [m for n, m in two.runtime.fleets["fleet"].members.items() if n != used[0]]
    assert all(m.state.index.matched(blocks) == 0 for m in others)


class FakeMember:
    def __init__(self) -> None:
        from gateway.upstreams.replicas.balancer import ReplicaState

        self.state = ReplicaState(name="r0")


class FakeFleet:
    def __init__(self) -> None:
        self.members = {"r0": FakeMember()}


def shared() -> SharedPlacements:
    return SharedPlacements(client=None, key_prefix="p", fleets={"fleet": FakeFleet()})


def test_placements_from_redis_are_checked_before_use() -> None:
    placements = shared()
    blocks = prefix_blocks("x" * 1024)
    good = ["fleet", "r0", b"".join(blocks).hex()]
    junk = [
        b"not json",
        b"[1,2,3]",
        orjson.dumps({"o": "other", "p": "nope"}),
        orjson.dumps({"o": "other", "p": [["fleet", "r9", good[2]]]}),  # unknown replica
        orjson.dumps({"o": "other", "p": [["other", "r0", good[2]]]}),  # unknown route
        orjson.dumps({"o": "other", "p": [["fleet", "r0", "zz" * 8]]}),  # not hex
        orjson.dumps({"o": "other", "p": [["fleet", "r0", "ab" * 5]]}),  # not whole digests
        orjson.dumps({"o": "other", "p": [["fleet", "r0", 7]]}),
        orjson.dumps({"o": placements.origin, "p": [good]}),  # our own
        b"{" + b" " * (5 * 1024 * 1024) + b"}",  # too big
    ]
    assert sum(placements.apply(message) for message in junk) == 0
    index = placements.fleets["fleet"].members["r0"].state.index
    assert len(index) == 0
    assert placements.apply(orjson.dumps({"o": "other", "p": [good]})) == 1
    assert index.matched(blocks) == len(blocks)


def test_pending_placements_are_bounded() -> None:
    placements = shared()
    for _ in range(5000):
        placements.placed("fleet", "r0", [b"12345678"])
    assert len(placements._pending) == 2048 and placements.dropped == 5000 - 2048
