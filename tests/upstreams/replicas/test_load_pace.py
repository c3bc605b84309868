"""An idle pool reads its servers' `/metrics` less and less often, and at once again when a
request is sent (`ReadPace`, in `ServerPool`'s load loop)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config.routes import Route
from gateway.upstreams.openai import OpenAIUpstream
from gateway.upstreams.replicas.pool import ServerPool
from gateway.upstreams.replicas.server_load import ReadPace
from tests.upstreams.test_origin_reads import Origin, answer, run


def test_an_idle_pace_doubles_up_to_its_cap_and_traffic_resets_it() -> None:
    pace = ReadPace(max_every=4)
    idle = [pace.due(active=False) for _ in range(15)]
    # reads at ticks 1, 3, 7, 11, 15: one, then every 2nd, then every 4th
    assert [i + 1 for i, read in enumerate(idle) if read] == [1, 3, 7, 11, 15]
    assert pace.due(active=True) and pace.due(active=True)
    assert [pace.due(active=False) for _ in range(3)] == [True, False, True]
    with pytest.raises(ValueError):
        ReadPace(max_every=0)


class RecordingPace(ReadPace):
    """A `ReadPace` that remembers each tick: (active, read)."""

    def __init__(self) -> None:
        super().__init__(max_every=4)
        self.ticks: list[tuple[bool, bool]] = []

    def due(self, active: bool) -> bool:
        read = super().due(active)
        self.ticks.append((active, read))
        return read


async def ticks_past(pace: RecordingPace, n: int) -> None:
    while len(pace.ticks) < n:
        await asyncio.sleep(0.005)


def test_the_load_loop_reads_on_the_pace_and_at_once_after_a_request_is_sent() -> None:
    async def main() -> None:
        async with Origin(answer(b"vllm:num_requests_waiting 3\n")) as origin:
            route = Route(
                name="fleet",
                models=["*"],
                kind="openai",
                replicas=[{"name": "a", "base_url": f"http://127.0.0.1:{origin.port}/v1"}],
                load_metrics="vllm",
                load_interval_s=0.001,
            )
            one = route.model_copy(update={"base_url": route.replicas[0].base_url, "replicas": ()})
            pool = ServerPool(
                route, route.replicas, [OpenAIUpstream(one, api_key=None)], "least_loaded"
            )
            pace = pool.load_pace = RecordingPace()
            await pool.start()
            try:
                await ticks_past(pace, 15)
                idle = pace.ticks[:15]
                assert not any(active for active, _ in idle)
                assert [i + 1 for i, (_, read) in enumerate(idle) if read] == [1, 3, 7, 11, 15]
                assert pool.members["a"].state.queue == 3
                member = pool.sent(pool.choose([]), [], None)
                sent_at = len(pace.ticks)
                await ticks_past(pace, sent_at + 3)
                assert pace.ticks[sent_at : sent_at + 3] == [(True, True)] * 3  # in flight
                pool.balancer.done(member.state)
                ended_at = len(pace.ticks)
                await ticks_past(pace, ended_at + 4)
                # idle again: the pace starts over from one tick
                after = pace.ticks[ended_at : ended_at + 4]
                assert after == [(False, True), (False, False), (False, True), (False, False)]
            finally:
                await pool.aclose()
            reads = [h for h in origin.heads if h.startswith(b"GET /metrics")]
            assert 0 < len(reads) <= sum(read for _, read in pace.ticks)

    run(main())
