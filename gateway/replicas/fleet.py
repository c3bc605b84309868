"""An `openai` route with several replicas, as one `Upstream`.

Each request's canonical prompt (the policies already ran) is cut into chained block hashes;
the `Balancer` picks a replica by expected cached share and load, among healthy ones. A request
that fails with a 5xx, a timeout or a broken connection ejects its replica for a backoff that
grows while it keeps failing (the proxy's retry then goes to another); a periodic probe brings
an ejected replica back. With `hedge_after_ms`, a stream whose first token has not come in time
is sent to the next-best replica too, and whichever produces a first token first is streamed;
the other is closed at once.

The proxy sees one upstream: retries, fallbacks, keepalives and telemetry work as for any route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.replicas.health import HealthPolicy, ReplicaHealth
from gateway.replicas.hedging import HedgeBudget, TtftTracker
from gateway.replicas.prefix_index import PrefixIndex, prefix_blocks, prompt_text
from gateway.replicas.server_load import MAX_METRICS_BYTES, parse_server_load
from gateway.routes import Route
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EventStream,
    ModelCard,
    OutEvent,
    UpstreamBody,
    UpstreamError,
)

if TYPE_CHECKING:
    import aiohttp

    from gateway.replicas.shared_index import SharedPlacements
    from gateway.upstream_paths import PassPath
    from gateway.upstreams.openai import OpenAIUpstream

log = logging.getLogger("firsttoken.replicas")

PROBE_TIMEOUT_S = 2.0
PROBE_LIMIT_BYTES = 256 * 1024
HEDGED_ENDPOINTS = frozenset({"chat", "completions"})


@dataclass
class ReplicaStats:
    requests: int = 0
    affinity_hits: int = 0
    errors: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0


@dataclass
class Member:
    """One replica: how to reach it, what the balancer knows of it, what it did."""

    upstream: OpenAIUpstream
    state: ReplicaState
    stats: ReplicaStats


class Fleet(Protocol):
    """What operators' views and shared placements read of a route with several servers
    (`ReplicatedUpstream`, and the prefill/decode router `gateway.pd.PDUpstream`)."""

    route: Route
    members: dict[str, Member]
    placements: SharedPlacements | None

    def snapshot(self) -> dict[str, Any]: ...


class ReplicatedUpstream:
    """The `Upstream` of a route with `replicas` (see the module docstring)."""

    def __init__(self, route: Route, upstreams: list[OpenAIUpstream]) -> None:
        self.route = route
        policy = HealthPolicy(base_eject_s=route.eject_s, max_eject_s=route.max_eject_s)
        self.members: dict[str, Member] = {}
        for name, replica, upstream in zip(
            route.replica_names(), route.replicas, upstreams, strict=True
        ):
            state = ReplicaState(
                name=name,
                weight=replica.weight,
                index=PrefixIndex(route.affinity_index_bytes),
                health=ReplicaHealth(policy),
            )
            self.members[name] = Member(upstream, state, ReplicaStats())
        self.balancer = Balancer(
            [m.state for m in self.members.values()], BalanceOptions(mode=route.balance)
        )
        self.budget = HedgeBudget(route.hedge_max_ratio)
        self.ttft = TtftTracker()
        self.hedges = {"sent": 0, "won": 0, "lost": 0}
        self._probe: asyncio.Task | None = None
        self._load: asyncio.Task | None = None
        self.placements: SharedPlacements | None = None  # set when Redis shares the indexes

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(*(m.upstream.start() for m in self.members.values()))
        self._probe = asyncio.ensure_future(self._probe_loop())
        if self.route.load_metrics is not None:
            self._load = asyncio.ensure_future(self._load_loop(self.route.load_metrics))

    async def warm_up(self) -> None:
        await asyncio.gather(
            *(m.upstream.warm_up() for m in self.members.values()), return_exceptions=True
        )

    async def aclose(self) -> None:
        for task in (self._probe, self._load):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(m.upstream.aclose() for m in self.members.values()), return_exceptions=True
        )

    async def _probe_loop(self) -> None:
        """Every `probe_interval_s`, a `GET /models` to each ejected replica; an answer brings
        it back before its backoff ends."""
        while True:
            await asyncio.sleep(self.route.probe_interval_s)
            now = time.monotonic()
            ejected = [m for m in self.members.values() if not m.state.health.healthy(now)]
            answers = await asyncio.gather(
                *(
                    m.upstream.http.get_json("/models", PROBE_TIMEOUT_S, PROBE_LIMIT_BYTES)
                    for m in ejected
                ),
                return_exceptions=True,
            )
            for member, answer in zip(ejected, answers, strict=True):
                if answer is not None and not isinstance(answer, BaseException):
                    member.state.health.probe_ok(time.monotonic())
                    log.info("route %s: replica %s is back", self.route.name, member.state.name)

    async def _load_loop(self, kind: str) -> None:
        """Every `load_interval_s`, each healthy replica's queue and KV cache usage from its
        `/metrics`; a replica that does not answer counts as unknown (its in-flight requests
        alone) until it does."""
        while True:
            await asyncio.sleep(self.route.load_interval_s)
            members = list(self.members.values())
            texts = await asyncio.gather(
                *(
                    m.upstream.http.get_origin_text("/metrics", PROBE_TIMEOUT_S, MAX_METRICS_BYTES)
                    for m in members
                ),
                return_exceptions=True,
            )
            for member, text in zip(members, texts, strict=True):
                state = member.state
                if isinstance(text, str):
                    load = parse_server_load(text, kind)
                    state.queue, state.kv_usage = load.queue, load.kv_usage
                else:
                    state.queue = state.kv_usage = None

    # -- what the proxy calls ---------------------------------------------------------------

    async def model_cards(self) -> list[ModelCard]:
        for member in self._by_health():
            cards = await member.upstream.model_cards()
            if cards:
                return cards
        return []

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """Passthrough paths (files, batches, ...) go to the first healthy replica in the
        configured order, so that objects created there are found there again."""
        return await self._by_health()[0].upstream.forward(method, path, headers, data)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        blocks = self._blocks(body, ctx)
        choice = self._choose(blocks)
        member = self.members[choice.replica.name]
        self._sent(choice, blocks)
        try:
            result = await member.upstream.complete(body, ctx)
        except UpstreamError as exc:
            self._failed(member, exc)
            raise
        finally:
            self.balancer.done(choice.replica)
        member.state.health.succeeded(time.monotonic())
        return result

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> EventStream:
        blocks = self._blocks(body, ctx)
        choice = self._choose(blocks)
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

    def _blocks(self, body: UpstreamBody, ctx: CallContext) -> list[bytes]:
        seed = ctx.tenant if self.route.affinity_per_tenant else ""
        return prefix_blocks(prompt_text(body), seed)

    def _choose(self, blocks: list[bytes], exclude: frozenset[str] = frozenset()) -> Choice:
        choice = self.balancer.choose(blocks, time.monotonic(), exclude)
        stats = self.members[choice.replica.name].stats
        stats.requests += 1
        if choice.reason == "affinity":
            stats.affinity_hits += 1
        return choice

    def _sent(self, choice: Choice, blocks: list[bytes]) -> None:
        self.balancer.sent(choice, blocks)
        if self.placements is not None and blocks:
            self.placements.placed(self.route.name, choice.replica.name, blocks)

    def _second(self, first: Choice, blocks: list[bytes]) -> Choice | None:
        """The hedge's replica: the next best healthy one, if the budget allows a hedge."""
        now = time.monotonic()
        try:
            second = self.balancer.choose(blocks, now, frozenset({first.replica.name}))
        except LookupError:
            return None
        if not second.replica.health.healthy(now) or not self.budget.allow(now):
            return None
        stats = self.members[second.replica.name].stats
        stats.requests += 1
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

    def _by_health(self) -> list[Member]:
        now = time.monotonic()
        members = list(self.members.values())
        return sorted(members, key=lambda m: not m.state.health.healthy(now))

    def _failed(self, member: Member, exc: BaseException) -> None:
        """A 5xx, a timeout or a broken connection ejects; a 4xx is the request's own."""
        status = getattr(exc, "status", 502)
        if status >= 500 or status == 429:
            member.stats.errors += 1
            member.state.health.failed(time.monotonic())

    # -- streams ----------------------------------------------------------------------------

    async def _open(
        self, choice: Choice, blocks: list[bytes], body: UpstreamBody, ctx: CallContext
    ) -> TrackedStream:
        member = self.members[choice.replica.name]
        self._sent(choice, blocks)
        sent = time.monotonic()
        try:
            stream = await member.upstream.open_stream(body, ctx)
        except UpstreamError as exc:
            self.balancer.done(choice.replica)
            self._failed(member, exc)
            raise
        except BaseException:
            self.balancer.done(choice.replica)
            raise
        return TrackedStream(stream, self, member, sent)

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

    def note_first_token(self, member: Member, seconds: float) -> None:
        self.ttft.add(seconds)
        member.stats.ttft_sum_s += seconds
        member.stats.ttft_count += 1

    def note_end(self, member: Member, failed: BaseException | None) -> None:
        self.balancer.done(member.state)
        if failed is not None:
            self._failed(member, failed)
        else:
            member.state.health.succeeded(time.monotonic())

    # -- what operators see -----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        replicas = []
        for name, member in self.members.items():
            state, stats = member.state, member.stats
            replicas.append(
                {
                    "name": name,
                    "state": state.health.state(now),
                    "in_flight": state.in_flight,
                    "queue": state.queue,
                    "kv_usage": state.kv_usage,
                    "ejections": state.health.ejections,
                    "requests": stats.requests,
                    "affinity_hits": stats.affinity_hits,
                    "errors": stats.errors,
                    "upstream_ttft_mean_ms": round(1000 * stats.ttft_sum_s / stats.ttft_count, 2)
                    if stats.ttft_count
                    else None,
                }
            )
        return {"balance": self.route.balance, "replicas": replicas, "hedges": dict(self.hedges)}


class TrackedStream:
    """A replica's event stream that tells the fleet its first token and its end (once), and
    can read ahead to its first content for a hedging race, then replay it."""

    def __init__(
        self, inner: EventStream, fleet: ReplicatedUpstream, member: Member, sent: float
    ) -> None:
        self._inner = inner
        self._fleet = fleet
        self._member = member
        self._sent = sent
        self._iterator: AsyncIterator[list[OutEvent]] | None = None
        self._held: list[list[OutEvent]] = []
        self._first_seen = False
        self._ended = False
        self.relayed = getattr(inner, "relayed", None)

    def _source(self) -> AsyncIterator[list[OutEvent]]:
        if self._iterator is None:
            self._iterator = self._inner.__aiter__()
        return self._iterator

    def _saw(self, batch: list[OutEvent]) -> bool:
        """Whether `batch` ends the wait for a first token (content, an error or the end)."""
        if self._first_seen:
            return True
        for event in batch:
            event.resolve()
            if event.content or event.error or event.done or event.malformed:
                self._first_seen = True
                self._fleet.note_first_token(self._member, time.monotonic() - self._sent)
                return True
        return False

    async def prefetch_first(self) -> None:
        source = self._source()
        while not self._first_seen:
            try:
                batch = await source.__anext__()
            except StopAsyncIteration:
                return
            self._held.append(batch)
            self._saw(batch)

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        failure: BaseException | None = None
        try:
            while self._held:
                yield self._held.pop(0)
            async for batch in self._source():
                if not self._first_seen:
                    self._saw(batch)
                yield batch
        except Exception as exc:  # an UpstreamError, aiohttp's payload errors: the replica broke
            failure = exc
            raise
        finally:
            self._end(failure or self._timed_out())

    def _end(self, failure: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._fleet.note_end(self._member, failure)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._inner.aclose()
        self._end(self._timed_out())

    def _timed_out(self) -> UpstreamError | None:
        """Closed without a first token once the route's first-token timeout had passed: the
        proxy gave up on this replica, which counts as its failure (a client that leaves
        earlier does not)."""
        limit = self._fleet.route.first_token_timeout_s
        if self._first_seen or limit is None or time.monotonic() - self._sent < 0.95 * limit:
            return None
        return UpstreamError("no first token in time", status=504)
