"""An `openai` route with several replicas, as one `Upstream`.

Each request's canonical prompt (the policies already ran) is cut into chained block hashes;
the `Balancer` picks a replica by expected cached share and load, among healthy ones. A request
that fails with a 5xx, a timeout or a broken connection ejects its replica for a backoff that
grows while it keeps failing (the proxy's retry then goes to another); a periodic probe brings
an ejected replica back. With `hedge_after_ms`, a stream whose first token has not come in time
is sent to the next-best replica too, and whichever produces a first token first is streamed;
the other is closed at once. A request that goes to a replica measured slow may hand its shared
prefix over to where its tenant's next conversation will go (`hand_over`). A request whose
prefix its replica is still computing for an earlier streamed request waits for that one's
first token, at most as long as computing the prefix again would take (`warming`).

The proxy sees one upstream: retries, fallbacks, keepalives and telemetry work as for any route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config.routes import Route
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EventStream,
    ModelCard,
    OutEvent,
    UpstreamBody,
)
from gateway.upstreams.replicas.balancer import Choice
from gateway.upstreams.replicas.hand_over import PrefixHandOver
from gateway.upstreams.replicas.hedging import HedgeBudget, TtftTracker
from gateway.upstreams.replicas.pool import (
    PROBE_LIMIT_BYTES,
    PROBE_TIMEOUT_S,
    Member,
    MemberStream,
    ReplicaStats,
    ServerPool,
    first_model_cards,
)
from gateway.upstreams.replicas.prefix_index import BlockChains, conversation_key, prompt_text
from gateway.upstreams.replicas.warming import PrefixWarming, Warming

if TYPE_CHECKING:
    import aiohttp

    from gateway.paths import PassPath
    from gateway.upstreams.openai import OpenAIUpstream
    from gateway.upstreams.replicas.shared_index import SharedPlacements

# `Member`, `ReplicaStats` and the probe limits live in `gateway.upstreams.replicas.pool`; other
# modules import them from here too.
__all__ = [
    "PROBE_LIMIT_BYTES",
    "PROBE_TIMEOUT_S",
    "Fleet",
    "Member",
    "ReplicaStats",
    "ReplicatedUpstream",
    "TrackedStream",
]

HEDGED_ENDPOINTS = frozenset({"chat", "completions"})


class Fleet(Protocol):
    """What operators' views read of a route with several servers (`ReplicatedUpstream`, and
    the prefill/decode router `gateway.upstreams.pd.PDUpstream`)."""

    route: Route
    members: dict[str, Member]
    placements: SharedPlacements | None

    def snapshot(self) -> dict[str, Any]: ...


class ReplicatedUpstream:
    """The `Upstream` of a route with `replicas` (see the module docstring): one `ServerPool`,
    with hedging on top."""

    def __init__(self, route: Route, upstreams: list[OpenAIUpstream]) -> None:
        self.route = route
        self.pool = ServerPool(route, route.replicas, upstreams, route.balance)
        self.members: dict[str, Member] = self.pool.members
        self.balancer = self.pool.balancer
        self.budget = HedgeBudget(route.hedge_max_ratio)
        self.ttft = TtftTracker()
        self.hedges = {"sent": 0, "won": 0, "lost": 0}
        self.placements: SharedPlacements | None = None  # set when Redis shares the indexes
        self.chains = BlockChains()  # a conversation's next turn hashes only what is new
        # prefixes being computed: a request sharing one waits (where prefixes place requests)
        self.warming = PrefixWarming()
        self.waits_for_prefixes = route.balance == "prefix_affinity"
        self.hand_over = (
            PrefixHandOver(self.pool, route.name)
            if route.hands_over_prefixes and len(self.members) > 1
            else None
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()

    async def warm_up(self) -> None:
        await self.pool.warm_up()

    async def aclose(self) -> None:
        if self.hand_over is not None:
            await self.hand_over.aclose()
        await self.pool.aclose()

    # -- what the proxy calls ---------------------------------------------------------------

    async def model_cards(self) -> list[ModelCard]:
        return await first_model_cards(self.members.values())

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """Passthrough paths (files, batches, ...) go to the first healthy replica in the
        configured order, so that objects created there are found there again."""
        return await self.pool.by_health()[0].upstream.forward(method, path, headers, data)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        blocks, choice = self._choose(body, ctx)
        await self._after_warming(choice, blocks)
        member = self.pool.sent(choice, blocks, self.placements)
        sent = time.monotonic()
        result = await self.pool.attempt(
            member, member.upstream.complete(body, ctx), tenant=ctx.tenant
        )
        self.pool.ended(member, None, ctx.tenant, sent, choice.free_slot)
        return result

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> EventStream:
        blocks, choice = self._choose(body, ctx)
        await self._after_warming(choice, blocks)
        now = time.monotonic()
        self.budget.request(now)
        after = self._hedge_after(body, ctx)
        if after is None:
            return await self._open(choice, blocks, body, ctx)
        primary = asyncio.ensure_future(self._open_first(choice, blocks, body, ctx))
        try:
            done, _ = await asyncio.wait({primary}, timeout=after)
            if done:
                return primary.result()
            second = self._second(choice, blocks)
            if second is None:
                return await primary
            self.hedges["sent"] += 1
            ctx.hedged = True
            secondary = asyncio.ensure_future(self._open_first(second, blocks, body, ctx))
            return await self._race(primary, secondary)
        except BaseException:
            primary.cancel()
            raise

    # -- choosing ---------------------------------------------------------------------------

    def _choose(self, body: UpstreamBody, ctx: CallContext) -> tuple[list[bytes], Choice]:
        """The prompt's block hashes and the pool's pick for it, told the prompt's length in
        characters, whether it opens a conversation (no assistant turn yet: what a cost on
        later turns applies to) and which conversation it belongs to."""
        seed = ctx.tenant if self.route.affinity_per_tenant else ""
        text = prompt_text(body)
        messages = body.get("messages")
        first_turn = not isinstance(messages, list) or not any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages
        )
        blocks = self.chains.blocks(text, seed)
        conversation = conversation_key(text, seed) if isinstance(messages, list) else None
        choice = self.pool.choose(
            blocks, prompt_chars=len(text), first_turn=first_turn, conversation=conversation
        )
        if choice.slow and self.hand_over is not None:
            self.hand_over.consider(
                body, ctx, choice.replica, blocks, time.monotonic(), self.placements
            )
        return blocks, choice

    async def _after_warming(self, choice: Choice, blocks: list[bytes]) -> None:
        """Wait while the chosen replica is still computing the prompt's matched prefix for an
        earlier request, at most as long as computing it again would take (`warming`)."""
        if not self.waits_for_prefixes:
            return
        name, matched = choice.replica.name, choice.matched_blocks
        pending = self.warming.pending(name, blocks, matched)
        if pending is None:
            return
        await self.warming.wait(pending, self.balancer.recompute_ms(matched) / 1000)

    def _second(self, first: Choice, blocks: list[bytes]) -> Choice | None:
        """The hedge's replica: the next best healthy one, if the budget allows a hedge."""
        now = time.monotonic()
        try:
            second = self.pool.choose(blocks, frozenset({first.replica.name}))
        except LookupError:
            return None
        if not second.replica.health.healthy(now) or not self.budget.allow(now):
            return None
        return second

    def _hedge_after(self, body: UpstreamBody, ctx: CallContext) -> float | None:
        """Seconds to wait for a first token before hedging; None: this request is not hedged
        (no hedging configured, a single replica, or a request with side effects: `store`)."""
        setting = self.route.hedge_after_ms
        if setting is None or len(self.members) < 2 or ctx.endpoint not in HEDGED_ENDPOINTS:
            return None
        if body.get("store"):
            return None
        if setting == "p95":
            return self.ttft.p95
        return float(setting) / 1000

    # -- streams ----------------------------------------------------------------------------

    async def _open(
        self, choice: Choice, blocks: list[bytes], body: UpstreamBody, ctx: CallContext
    ) -> TrackedStream:
        member = self.pool.sent(choice, blocks, self.placements)
        sent = time.monotonic()
        warming = (
            self.warming.start(choice.replica.name, blocks, choice.matched_blocks)
            if self.waits_for_prefixes
            else None
        )
        try:
            stream = await self.pool.attempt(
                member, member.upstream.open_stream(body, ctx), tenant=ctx.tenant
            )
        except BaseException:
            self.warming.finish(warming)
            raise
        return TrackedStream(stream, self, member, sent, ctx.tenant, choice, warming)

    async def _open_first(
        self, choice: Choice, blocks: list[bytes], body: UpstreamBody, ctx: CallContext
    ) -> TrackedStream:
        """Open the stream and read up to its first content (kept for replay), so that a race
        between two replicas is won by the first token, not by the first byte."""
        stream = await self._open(choice, blocks, body, ctx)
        try:
            await stream.prefetch_first()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def _race(self, primary: asyncio.Future, secondary: asyncio.Future) -> TrackedStream:
        pending = {primary, secondary}
        winner: asyncio.Future | None = None
        failures: list[BaseException] = []
        try:
            while pending and winner is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        failures.append(error)
                    elif winner is None:
                        winner = task
                    else:  # both came in the same tick: the later one is closed
                        await task.result().aclose()
        finally:
            for task in pending:
                task.cancel()
        if winner is None:
            raise failures[0]
        self.hedges["won" if winner is secondary else "lost"] += 1
        return winner.result()

    def note_first_token(
        self, member: Member, seconds: float, choice: Choice | None = None
    ) -> None:
        self.ttft.add(seconds)
        self.pool.note_ttft(member, seconds)
        if choice is not None:
            self.balancer.first_token(choice, seconds)

    def note_end(
        self,
        member: Member,
        failed: BaseException | None,
        tenant: str = "",
        sent: float | None = None,
        free_slot: bool = True,
    ) -> None:
        self.pool.ended(member, failed, tenant, sent, free_slot)

    # -- what operators see -----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        replicas = self.pool.rows(time.monotonic())
        snapshot = {
            "balance": self.route.balance,
            "replicas": replicas,
            "hedges": dict(self.hedges),
            "prefix_waits": {
                "requests": self.warming.waits,
                "waited_ms": round(1000 * self.warming.waited_s, 1),
            },
            "cost": self.balancer.costs(),
        }
        if self.hand_over is not None:
            snapshot["hand_overs"] = dataclasses.asdict(self.hand_over.counts)
        return snapshot


class TrackedStream(MemberStream):
    """A replica's event stream that tells the fleet its first token and its end (once), and
    can read ahead to its first content for a hedging race, then replay it."""

    def __init__(
        self,
        inner: EventStream,
        fleet: ReplicatedUpstream,
        member: Member,
        sent: float,
        tenant: str = "",
        choice: Choice | None = None,
        warming: Warming | None = None,
    ) -> None:
        super().__init__(inner, member, fleet.route.first_token_timeout_s, sent)
        self._fleet = fleet
        self._tenant = tenant
        self._choice = choice
        self._warming = warming

    def _saw(self, batch: list[OutEvent]) -> None:
        """A first token is content, an error or the end."""
        for event in batch:
            event.resolve()
            if event.content or event.error or event.done or event.malformed:
                self._first_seen = True
                self._fleet.warming.finish(self._warming)
                self._fleet.note_first_token(
                    self._member, time.monotonic() - self._since, self._choice
                )
                return

    async def prefetch_first(self) -> None:
        source = self._source()
        while not self._first_seen:
            try:
                batch = await source.__anext__()
            except StopAsyncIteration:
                return
            self._held.append(batch)
            self._saw(batch)

    def _finish(self, failure: BaseException | None) -> None:
        self._fleet.warming.finish(self._warming)
        free_slot = self._choice is None or self._choice.free_slot
        self._fleet.note_end(self._member, failure, self._tenant, self._since, free_slot)
