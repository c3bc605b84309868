"""A pool of interchangeable servers behind one route: the members, their balancer, their health.

A replicated route is one pool (`gateway.upstreams.replicas.fleet`); a pd route is two, prefill and
decode (`gateway.upstreams.pd.router`). What a server's life looks like is the same in every pool,
so it lives here once: the `Balancer` picks a member, its own failures (`ReplicaHealth`: gateway
errors in a row, or a failure rate that more than one tenant sees) eject it for a backoff that
grows while it keeps failing, a periodic `GET /models` brings an ejected member back early, and
(with `load_metrics`) a periodic `/metrics` read feeds its queue and KV cache usage to the
balancer. The pool's owner decides what a request is; the pool keeps the
counts operators see (`rows`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.config.routes import Replica, Route, pool_names
from gateway.upstreams.base import (
    Diverted,
    EventStream,
    ModelCard,
    OnBatch,
    OutEvent,
    UpstreamError,
    close_iterator,
)
from gateway.upstreams.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.upstreams.replicas.health import (
    EjectionLimit,
    HealthPolicy,
    ReplicaHealth,
    failure_kind,
)
from gateway.upstreams.replicas.prefix_index import PrefixIndex
from gateway.upstreams.replicas.server_load import (
    MAX_METRICS_BYTES,
    ReadPace,
    parse_server_load,
)

if TYPE_CHECKING:
    from gateway.upstreams.openai import OpenAIUpstream
    from gateway.upstreams.replicas.shared_index import SharedPlacements

log = logging.getLogger("firsttoken.replicas")
T = TypeVar("T")

PROBE_TIMEOUT_S = 2.0
PROBE_LIMIT_BYTES = 256 * 1024


@dataclass
class ReplicaStats:
    """A member's counters. Every field but `ttft_*` is shown as is in `ServerPool.rows`; a
    subclass adds its own that way."""

    requests: int = 0
    affinity_hits: int = 0
    errors: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0


@dataclass
class Member:
    """One server: how to reach it, what the balancer knows of it, what it did."""

    upstream: OpenAIUpstream
    state: ReplicaState
    stats: ReplicaStats


class ServerPool:
    """Servers of one role in one route, chosen by `mode` (a `BalanceOptions.mode`).

    `prefix` names the members outside the pool (`"prefill/"` in a pd route, nothing in a
    replicated one): in logs, in shared placements and in `rows`."""

    def __init__(
        self,
        route: Route,
        replicas: Sequence[Replica],
        upstreams: Sequence[OpenAIUpstream],
        mode: str,
        prefix: str = "",
        stats: Callable[[], ReplicaStats] = ReplicaStats,
        own_requests: bool = False,
    ) -> None:
        self.route = route
        self.prefix = prefix
        # requests the gateway makes itself (a pd route's prefill step) cannot be a tenant's
        # bad body: any 5xx to them is the server's
        self.own_requests = own_requests
        policy = HealthPolicy(base_eject_s=route.eject_s, max_eject_s=route.max_eject_s)
        limit = EjectionLimit(policy.max_ejected_share)
        self.members: dict[str, Member] = {}
        for name, replica, upstream in zip(pool_names(replicas), replicas, upstreams, strict=True):
            state = ReplicaState(
                name=name,
                weight=replica.weight,
                index=PrefixIndex(route.affinity_index_bytes),
                health=ReplicaHealth(policy, limit),
            )
            self.members[name] = Member(upstream, state, stats())
        self.balancer = Balancer(
            [m.state for m in self.members.values()], BalanceOptions(mode=mode)
        )
        self._tasks: list[asyncio.Task] = []
        self.load_pace = ReadPace()

    def named(self) -> dict[str, Member]:
        """The members under their outside names."""
        return {self.prefix + name: m for name, m in self.members.items()}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(*(m.upstream.start() for m in self.members.values()))
        self._tasks = [asyncio.ensure_future(self._probe_loop())]
        if self.route.load_metrics is not None:
            self._tasks.append(asyncio.ensure_future(self._load_loop(self.route.load_metrics)))

    async def warm_up(self) -> None:
        await asyncio.gather(
            *(m.upstream.warm_up() for m in self.members.values()), return_exceptions=True
        )

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(
            *(m.upstream.aclose() for m in self.members.values()), return_exceptions=True
        )

    async def _probe_loop(self) -> None:
        """At start and then every `probe_interval_s`, a `GET /models` to each member that is
        ejected or never answered; an answer brings it back before its backoff ends (and makes
        a starting one healthy in `/readyz`)."""
        while True:
            now = time.monotonic()
            ejected = [
                m
                for m in self.members.values()
                if not m.state.health.healthy(now) or not m.state.health.answered
            ]
            answers = await asyncio.gather(
                *(
                    m.upstream.http.get_json("/models", PROBE_TIMEOUT_S, PROBE_LIMIT_BYTES)
                    for m in ejected
                ),
                return_exceptions=True,
            )
            for member, answer in zip(ejected, answers, strict=True):
                if answer is not None and not isinstance(answer, BaseException):
                    health = member.state.health
                    if not health.healthy(time.monotonic()):
                        log.info(
                            "route %s: %s%s is back",
                            self.route.name,
                            self.prefix,
                            member.state.name,
                        )
                    health.probe_ok(time.monotonic())
            await asyncio.sleep(self.route.probe_interval_s)

    async def _load_loop(self, kind: str) -> None:
        """Every `load_interval_s`, each member's queue and KV cache usage from its `/metrics`
        (less often while the pool is sent nothing: `ReadPace`); a member that does not
        answer counts as unknown (its in-flight requests alone) until it does."""
        sends_seen = self._sends()
        while True:
            await asyncio.sleep(self.route.load_interval_s)
            members = list(self.members.values())
            sends = self._sends()
            active = sends != sends_seen or any(m.state.in_flight for m in members)
            if not self.load_pace.due(active):
                continue
            sends_seen = sends
            before = [m.state.in_flight for m in members]
            texts = await asyncio.gather(
                *(
                    m.upstream.http.read_origin_text("/metrics", PROBE_TIMEOUT_S, MAX_METRICS_BYTES)
                    for m in members
                ),
                return_exceptions=True,
            )
            for member, text, then in zip(members, texts, before, strict=True):
                state = member.state
                if isinstance(text, str):
                    load = parse_server_load(text, kind)
                    state.queue, state.kv_usage = load.queue, load.kv_usage
                    # the server counted its queue at some moment between the read's start and
                    # its answer: the more of the gateway's own in flight of the two is the
                    # more of that queue that may be its own, never read as others'
                    state.in_flight_at_report = max(then, state.in_flight)
                    state.health.heard()
                else:
                    state.queue = state.kv_usage = None

    def _sends(self) -> int:
        """Requests sent to any member so far: the load loop's sign of traffic."""
        return sum(m.stats.requests for m in self.members.values())

    # -- a request's life on a member -------------------------------------------------------

    def choose(
        self,
        blocks: list[bytes],
        exclude: frozenset[str] = frozenset(),
        prompt_chars: int | None = None,
        first_turn: bool = True,
        conversation: int | None = None,
    ) -> Choice:
        """The balancer's pick; `LookupError` when `exclude` leaves no member."""
        return self.balancer.choose(
            blocks, time.monotonic(), exclude, prompt_chars, first_turn, conversation
        )

    def sent(
        self, choice: Choice, blocks: list[bytes], placements: SharedPlacements | None
    ) -> Member:
        """A request goes to `choice`: count it, hold its slot, and tell the member's new
        prefix to the balancer (and to the other gateways, with `placements`)."""
        member = self.members[choice.replica.name]
        member.stats.requests += 1
        if choice.reason == "affinity":
            member.stats.affinity_hits += 1
        self.balancer.sent(choice, blocks)
        if placements is not None and blocks:
            placements.placed(self.route.name, self.prefix + choice.replica.name, blocks)
        return member

    async def attempt(
        self,
        member: Member,
        call: Awaitable[T],
        blame: Callable[[UpstreamError], bool] = lambda exc: True,
        tenant: str = "",
    ) -> T:
        """`call`'s result. A failure frees the member's slot, and an `UpstreamError` that
        `blame` lays on the member counts against it (`failed`); a success keeps the slot
        until the caller reports the end (`ended`)."""
        try:
            return await call
        except UpstreamError as exc:
            self.balancer.done(member.state)
            if blame(exc):
                self.failed(member, exc, tenant)
            raise
        except BaseException:
            self.balancer.done(member.state)
            raise

    def failed(self, member: Member, exc: BaseException, tenant: str = "") -> None:
        """`exc` (from `tenant`'s request) counts against the member as `failure_kind` says:
        a 502/503/504, a timeout or a broken connection (no status: 502) as the server's
        own, another 5xx as one the request may have caused, a 4xx or 429 not at all."""
        status = getattr(exc, "status", 502)
        health = member.state.health
        if getattr(exc, "body", None) is not None:
            health.heard()  # it answered, if with an error: it is up
        kind = failure_kind(status)
        if kind is None:
            return
        member.stats.errors += 1
        health.failed(time.monotonic(), "gateway" if self.own_requests else kind, tenant)

    def ended(
        self,
        member: Member,
        failure: BaseException | None,
        tenant: str = "",
        sent: float | None = None,
        free_slot: bool = True,
    ) -> None:
        """A request that `sent` counted (at monotonic `sent`, when known; `free_slot`: the
        member had a slot free then) has ended: free its slot, judge the member."""
        held = None if failure is not None or sent is None else time.monotonic() - sent
        self.balancer.done(member.state, held, free_slot)
        if failure is not None:
            self.failed(member, failure, tenant)
        else:
            member.state.health.succeeded(time.monotonic())

    def note_ttft(self, member: Member, seconds: float) -> None:
        member.stats.ttft_sum_s += seconds
        member.stats.ttft_count += 1

    def by_health(self) -> list[Member]:
        return by_health(self.members.values())

    # -- what operators see -----------------------------------------------------------------

    def rows(self, now: float, **extra: Any) -> list[dict[str, Any]]:
        """One row a member (its name inside the pool); `extra` goes in every row."""
        rows = []
        for name, member in self.members.items():
            state, stats = member.state, member.stats
            counts = {k: v for k, v in asdict(stats).items() if not k.startswith("ttft_")}
            rows.append(
                {
                    "name": name,
                    **extra,
                    "state": state.health.state(now),
                    "in_flight": state.in_flight,
                    "queue": state.queue,
                    "kv_usage": state.kv_usage,
                    "ejections": state.health.ejections,
                    **counts,
                    "upstream_ttft_mean_ms": mean_ms(stats.ttft_sum_s, stats.ttft_count),
                }
            )
        return rows


def by_health(members: Iterable[Member]) -> list[Member]:
    """`members` in their order, healthy ones first."""
    now = time.monotonic()
    return sorted(members, key=lambda m: not m.state.health.healthy(now))


async def first_model_cards(members: Iterable[Member]) -> list[ModelCard]:
    """The model list of the first member that gives one, healthy members first."""
    for member in by_health(members):
        cards = await member.upstream.model_cards()
        if cards:
            return cards
    return []


def mean_ms(total_s: float, count: int) -> float | None:
    return round(1000 * total_s / count, 3) if count else None


class MemberStream:
    """A member's event stream that reports its end once (`_finish`): a failure while reading
    is the member's, and so is a close without a first event once the route's first-token
    timeout had passed (the proxy gave up on this member; a client that leaves earlier does
    not count). Subclasses watch the batches until the first event (`_saw`)."""

    def __init__(
        self, inner: EventStream, member: Member, timeout_s: float | None, since: float
    ) -> None:
        self._inner = inner
        self._member = member
        self._timeout_s = timeout_s
        self._since = since  # monotonic: what the first-token timeout counts from
        self._iterator: AsyncIterator[list[OutEvent]] | None = None
        self._held: list[list[OutEvent]] = []  # read ahead, replayed first
        self._first_seen = False
        self._ended = False
        self.relayed = getattr(inner, "relayed", None)

    def _saw(self, batch: list[OutEvent]) -> None:
        """Look for the first event in `batch`; set `_first_seen` once it came."""
        raise NotImplementedError

    def _finish(self, failure: BaseException | None) -> None:
        """The stream ended (`failure`: None when it ended well)."""
        raise NotImplementedError

    def _source(self) -> AsyncIterator[list[OutEvent]]:
        if self._iterator is None:
            self._iterator = self._inner.__aiter__()
        return self._iterator

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        failure: BaseException | None = None
        try:
            while self._held:
                yield self._held.pop(0)
            async for batch in self._source():
                if not self._first_seen:
                    self._saw(batch)
                yield batch
        except Exception as exc:  # an UpstreamError, aiohttp's payload errors: the server broke
            failure = exc
            raise
        finally:
            self._end(failure or self._timed_out())

    def divert(self, on_batch: OnBatch) -> Diverted | None:
        """The member's stream diverted (see `Diverted`), its end reported as `__aiter__`
        reports it; None while batches read ahead wait to be replayed, or when the inner
        stream cannot be diverted."""
        divert = getattr(self._inner, "divert", None)
        if divert is None or self._held:
            return None

        def watched(batch: list[OutEvent]) -> bool:
            if not self._first_seen:
                self._saw(batch)
            return on_batch(batch)

        inner = divert(on_batch if self._first_seen else watched)
        return None if inner is None else _DivertedMember(self, inner)

    def _end(self, failure: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._finish(failure)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await close_iterator(self._iterator)  # read from, maybe not to its end
        with contextlib.suppress(Exception):
            await self._inner.aclose()
        self._end(self._timed_out())

    def _timed_out(self) -> UpstreamError | None:
        limit = self._timeout_s
        if self._first_seen or limit is None or time.monotonic() - self._since < 0.95 * limit:
            return None
        return UpstreamError("no first token in time", status=504)


class _DivertedMember:
    """A member's diverted stream: a failure is the member's, as when read through
    `MemberStream.__aiter__` (a good end is reported when the stream is closed)."""

    def __init__(self, stream: MemberStream, inner: Diverted) -> None:
        self._stream = stream
        self._inner = inner

    async def ended(self) -> None:
        try:
            await self._inner.ended()
        except Exception as exc:
            self._stream._end(exc)
            raise

    def pause(self) -> None:
        self._inner.pause()

    def resume(self) -> None:
        self._inner.resume()

    def stop(self) -> None:
        self._inner.stop()
