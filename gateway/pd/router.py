"""A `pd` route: prefill and decode servers behind one `Upstream` (see `gateway.pd.wire`).

Each request is prefilled on the prefill server most likely to hold its prefix (the same prefix
affinity as replicated routes: a prefill server's cache is what saves compute), then decoded on
the least loaded decode server (decode is memory-bound: what matters there is how many streams
share it). Both pools eject a server that fails (5xx, 429, timeouts, broken connections) and
probe it back, as `gateway.replicas.fleet` does.

PD is an optimisation, never a new way to fail: when the prefill step fails, times out, answers
503 (a prefill server out of room for held blocks) or gives no usable `kv_transfer_params`, or
when every prefill server is ejected, the request goes to a decode server as an ordinary request.
A decode step that fails while pulling KV is tried once more, colocated, on another decode
server. Only a decode server failing an ordinary request is the request's failure (the proxy
then retries or falls back as on any route).

Per request the prefill step's latency, the handoff (prefill answer to decode request) and the
decode server's time to first content are kept apart, per server and per route (`snapshot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from gateway.pd.wire import decode_body, kv_params_from, prefill_body
from gateway.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.replicas.fleet import PROBE_LIMIT_BYTES, PROBE_TIMEOUT_S, Member, ReplicaStats
from gateway.replicas.health import HealthPolicy, ReplicaHealth
from gateway.replicas.prefix_index import PrefixIndex, prefix_blocks, prompt_text
from gateway.replicas.server_load import MAX_METRICS_BYTES, parse_server_load
from gateway.routes import Replica, Route, pool_names
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EncodedBody,
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

log = logging.getLogger("firsttoken.pd")
T = TypeVar("T")

# Why a request went colocated (the keys of `PDStats.colocated`).
FALLBACK_REASONS = (
    "no_prefill_server",  # every prefill server is ejected
    "prefill_error",  # a 5xx/4xx or a broken connection
    "prefill_timeout",  # no answer within the route's pd.prefill_timeout_s
    "prefill_busy",  # 503: the prefill server holds all the blocks it may
    "no_kv_params",  # an answer without a usable kv_transfer_params
    "handoff_failed",  # the decode server failed the request that carried the params
)


@dataclass
class PDServerStats(ReplicaStats):
    """A pool member's counters. `ttft_*` is the prefill step's latency on a prefill server
    (its first and only token) and the time to first content on a decode server."""

    remote_prefills: int = 0  # decode requests that carried kv_transfer_params


@dataclass
class PDStats:
    """The route's counters, one request counted once however its steps went."""

    requests: int = 0
    colocated: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))
    prefill_sum_s: float = 0.0
    prefill_count: int = 0
    handoff_sum_s: float = 0.0
    handoff_count: int = 0
    decode_ttft_sum_s: float = 0.0
    decode_ttft_count: int = 0


@dataclass
class Handoff:
    """What the prefill step left for the decode step."""

    params: dict[str, Any] | None  # None: decode colocated
    prefill_server: str | None = None
    reason: str | None = None  # why colocated, one of FALLBACK_REASONS
    answered: float = 0.0  # perf_counter when the prefill answer came
    prefill_s: float | None = None


@dataclass(frozen=True)
class PDTiming:
    """One request's steps, for a per-request telemetry sink (`PDUpstream.on_request`)."""

    request_id: str
    prefill_server: str | None
    decode_server: str
    colocated_reason: str | None
    prefill_s: float | None
    handoff_s: float | None
    decode_ttft_s: float | None  # streams only; None when no content came
    failed: bool


class PDUpstream:
    """The `Upstream` of a route with `pd` (see the module docstring)."""

    def __init__(
        self,
        route: Route,
        prefill: Sequence[OpenAIUpstream],
        decode: Sequence[OpenAIUpstream],
    ) -> None:
        if route.pd is None:
            raise ValueError(f"route {route.name!r} has no pd pools")
        self.route = route
        self.pd = route.pd
        policy = HealthPolicy(base_eject_s=route.eject_s, max_eject_s=route.max_eject_s)
        self.prefill = _pool(route, self.pd.prefill, prefill, policy)
        self.decode = _pool(route, self.pd.decode, decode, policy)
        # One namespace for both pools ("prefill/<name>", "decode/<name>"): the shape
        # `FleetCollector`, `/readyz` and `SharedPlacements` read from a replicated route.
        self.members: dict[str, Member] = {
            **{f"prefill/{name}": m for name, m in self.prefill.items()},
            **{f"decode/{name}": m for name, m in self.decode.items()},
        }
        self.prefill_balancer = Balancer(
            [m.state for m in self.prefill.values()], BalanceOptions(mode="prefix_affinity")
        )
        self.decode_balancer = Balancer(
            [m.state for m in self.decode.values()], BalanceOptions(mode="least_loaded")
        )
        self.stats = PDStats()
        self.placements: SharedPlacements | None = None  # set when Redis shares the indexes
        self.on_request: Callable[[PDTiming], None] | None = None
        self._tasks: list[asyncio.Task] = []

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
        """Every `probe_interval_s`, a `GET /models` to each ejected server of either pool; an
        answer brings it back before its backoff ends."""
        while True:
            await asyncio.sleep(self.route.probe_interval_s)
            now = time.monotonic()
            ejected = [(n, m) for n, m in self.members.items() if not m.state.health.healthy(now)]
            answers = await asyncio.gather(
                *(
                    m.upstream.http.get_json("/models", PROBE_TIMEOUT_S, PROBE_LIMIT_BYTES)
                    for _, m in ejected
                ),
                return_exceptions=True,
            )
            for (name, member), answer in zip(ejected, answers, strict=True):
                if answer is not None and not isinstance(answer, BaseException):
                    member.state.health.probe_ok(time.monotonic())
                    log.info("route %s: %s is back", self.route.name, name)

    async def _load_loop(self, kind: str) -> None:
        """Every `load_interval_s`, each server's queue and KV cache usage from its `/metrics`
        (what least-loaded decode and the prefill cost function weigh)."""
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
        for member in _by_health([*self.decode.values(), *self.prefill.values()]):
            cards = await member.upstream.model_cards()
            if cards:
                return cards
        return []

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """Passthrough paths go to the first healthy decode server in the configured order
        (decode servers are the ones that answer clients)."""
        member = _by_health(list(self.decode.values()))[0]
        return await member.upstream.forward(method, path, headers, data)

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> EventStream:
        body, ctx = await _prepared(body, ctx)
        began = time.monotonic()
        handoff = await self._prefill(body, ctx)
        return await self._decode(
            handoff, lambda member, h: self._stream_on(member, body, ctx, h, began)
        )

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        body, ctx = await _prepared(body, ctx)
        handoff = await self._prefill(body, ctx)
        return await self._decode(
            handoff, lambda member, h: self._complete_on(member, body, ctx, h)
        )

    # -- step 1: prefill --------------------------------------------------------------------

    async def _prefill(self, body: UpstreamBody, ctx: CallContext) -> Handoff:
        self.stats.requests += 1
        seed = ctx.tenant if self.route.affinity_per_tenant else ""
        blocks = prefix_blocks(prompt_text(body), seed)
        choice = self.prefill_balancer.choose(blocks, time.monotonic())
        if choice.reason == "only_unhealthy":
            # Every prefill server failed recently: waiting on one again would only delay the
            # colocated answer. The probe or the end of a backoff brings them back.
            return self._colocated(None, "no_prefill_server")
        name = choice.replica.name
        member = self.prefill[name]
        self._prefill_sent(member, choice, blocks)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.pd.prefill_timeout_s):
                result = await member.upstream.complete(prefill_body(body), ctx)
        except TimeoutError:
            self._failed(member, UpstreamError("prefill timed out", status=504))
            return self._colocated(name, "prefill_timeout")
        except UpstreamError as exc:
            self._failed(member, exc)
            busy = exc.status == 503 and exc.body is not None  # an answer, not a lost connection
            return self._colocated(name, "prefill_busy" if busy else "prefill_error")
        except Exception as exc:  # noqa: BLE001  # a body cut short: this server broke, not the request
            self._failed(member, exc)
            return self._colocated(name, "prefill_error")
        finally:
            self.prefill_balancer.done(choice.replica)
        answered = time.perf_counter()
        member.state.health.succeeded(time.monotonic())
        params = kv_params_from(result.body)
        if params is None:
            log.warning(
                "route %s: prefill server %s answered without kv_transfer_params "
                "(is it started with a KV connector?)",
                self.route.name,
                name,
            )
            return self._colocated(name, "no_kv_params")
        seconds = answered - started
        member.stats.ttft_sum_s += seconds
        member.stats.ttft_count += 1
        self.stats.prefill_sum_s += seconds
        self.stats.prefill_count += 1
        return Handoff(params, name, None, answered, seconds)

    def _prefill_sent(self, member: Member, choice: Choice, blocks: list[bytes]) -> None:
        member.stats.requests += 1
        if choice.reason == "affinity":
            member.stats.affinity_hits += 1
        self.prefill_balancer.sent(choice, blocks)
        if self.placements is not None and blocks:
            self.placements.placed(self.route.name, f"prefill/{choice.replica.name}", blocks)

    def _colocated(self, prefill_server: str | None, reason: str) -> Handoff:
        self.stats.colocated[reason] += 1
        return Handoff(None, prefill_server, reason)

    # -- step 3: decode ---------------------------------------------------------------------

    async def _decode(self, handoff: Handoff, call: Callable[[Member, Handoff], Awaitable[T]]) -> T:
        """`call` on the least loaded decode server; a failure of a request that carried
        kv_transfer_params is tried once more, colocated, on another server if there is one."""
        first = self._choose_decode(frozenset())
        if handoff.params is None:
            return await call(first, handoff)
        try:
            return await call(first, handoff)
        except UpstreamError as exc:
            log.info(
                "route %s: decode server %s failed a remote prefill (%s); decoding colocated",
                self.route.name,
                first.state.name,
                exc.status,
            )
        colocated = self._colocated(handoff.prefill_server, "handoff_failed")
        return await call(self._choose_decode(frozenset({first.state.name})), colocated)

    def _choose_decode(self, exclude: frozenset[str]) -> Member:
        now = time.monotonic()
        try:
            choice = self.decode_balancer.choose([], now, exclude)
        except LookupError:  # a one-server pool: the same server again
            choice = self.decode_balancer.choose([], now)
        return self.decode[choice.replica.name]

    def _decode_sent(self, member: Member) -> float:
        member.stats.requests += 1
        member.state.in_flight += 1  # what `Balancer.sent` does; decode keeps no prefix index
        return time.perf_counter()

    def _decode_opened(self, member: Member, handoff: Handoff, sent: float) -> float | None:
        """The decode server took the request: count the handoff (answer -> decode sent)."""
        if handoff.params is None:
            return None
        assert isinstance(member.stats, PDServerStats)
        member.stats.remote_prefills += 1
        seconds = sent - handoff.answered
        self.stats.handoff_sum_s += seconds
        self.stats.handoff_count += 1
        return seconds

    def _decode_failed(self, member: Member, handoff: Handoff, exc: UpstreamError) -> None:
        """With kv_transfer_params, a decode server that answered an error may be failing to
        pull from the prefill server: not its own fault, unless it did not answer at all."""
        self.decode_balancer.done(member.state)
        if handoff.params is None or exc.body is None:
            self._failed(member, exc)

    async def _stream_on(
        self, member: Member, body: UpstreamBody, ctx: CallContext, handoff: Handoff, began: float
    ) -> PDStream:
        sent = self._decode_sent(member)
        try:
            stream = await member.upstream.open_stream(decode_body(body, handoff.params), ctx)
        except UpstreamError as exc:
            self._decode_failed(member, handoff, exc)
            raise
        except BaseException:
            self.decode_balancer.done(member.state)
            raise
        handoff_s = self._decode_opened(member, handoff, sent)
        return PDStream(stream, self, member, ctx.request_id, handoff, handoff_s, sent, began)

    async def _complete_on(
        self, member: Member, body: UpstreamBody, ctx: CallContext, handoff: Handoff
    ) -> Completed:
        sent = self._decode_sent(member)
        try:
            result = await member.upstream.complete(decode_body(body, handoff.params), ctx)
        except UpstreamError as exc:
            self._decode_failed(member, handoff, exc)
            raise
        except BaseException:
            self.decode_balancer.done(member.state)
            raise
        self.decode_balancer.done(member.state)
        member.state.health.succeeded(time.monotonic())
        handoff_s = self._decode_opened(member, handoff, sent)
        self._report(ctx.request_id, member, handoff, handoff_s, None, failed=False)
        return result

    def _failed(self, member: Member, exc: BaseException) -> None:
        """A 5xx, a 429, a timeout or a broken connection ejects; a 4xx is the request's own."""
        status = getattr(exc, "status", 502)
        if status >= 500 or status == 429:
            member.stats.errors += 1
            member.state.health.failed(time.monotonic())

    def note_first_content(self, member: Member, seconds: float) -> None:
        member.stats.ttft_sum_s += seconds
        member.stats.ttft_count += 1
        self.stats.decode_ttft_sum_s += seconds
        self.stats.decode_ttft_count += 1

    def note_end(self, member: Member, failed: BaseException | None) -> None:
        self.decode_balancer.done(member.state)
        if failed is not None:
            self._failed(member, failed)
        else:
            member.state.health.succeeded(time.monotonic())

    def _report(
        self,
        request_id: str,
        member: Member,
        handoff: Handoff,
        handoff_s: float | None,
        ttft_s: float | None,
        failed: bool,
    ) -> None:
        if self.on_request is None:
            return
        timing = PDTiming(
            request_id,
            handoff.prefill_server,
            member.state.name,
            handoff.reason,
            handoff.prefill_s,
            handoff_s,
            ttft_s,
            failed,
        )
        try:
            self.on_request(timing)
        except Exception:  # a telemetry sink must never break a request
            log.exception("route %s: pd telemetry hook failed", self.route.name)

    # -- what operators see -----------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Both pools and the route's step timings. `replicas` and `hedges` repeat the pools in
        a replicated route's shape (names `prefill/<name>`, `decode/<name>`) for the readers of
        that shape (`FleetCollector`, `/readyz`)."""
        now = time.monotonic()
        prefill = [_server(name, m, now, "prefill") for name, m in self.prefill.items()]
        decode = [_server(name, m, now, "decode") for name, m in self.decode.items()]
        s = self.stats
        return {
            "mode": "pd",
            "prefill": prefill,
            "decode": decode,
            "pd": {
                "requests": s.requests,
                "colocated_fallbacks": sum(s.colocated.values()),
                "colocated_by_reason": dict(s.colocated),
                "prefill_ms_mean": _mean_ms(s.prefill_sum_s, s.prefill_count),
                "handoff_ms_mean": _mean_ms(s.handoff_sum_s, s.handoff_count),
                "decode_ttft_ms_mean": _mean_ms(s.decode_ttft_sum_s, s.decode_ttft_count),
                "prefill_count": s.prefill_count,
                "handoff_count": s.handoff_count,
                "decode_ttft_count": s.decode_ttft_count,
            },
            "replicas": [
                {**server, "name": f"{server['role']}/{server['name']}"}
                for server in (*prefill, *decode)
            ],
            "hedges": {},
        }


class PDStream:
    """A decode server's event stream that tells the router its first content and its end
    (once), and reports the request's steps at the end."""

    def __init__(
        self,
        inner: EventStream,
        router: PDUpstream,
        member: Member,
        request_id: str,
        handoff: Handoff,
        handoff_s: float | None,
        sent: float,
        began: float,
    ) -> None:
        self._inner = inner
        self._router = router
        self._member = member
        self._request_id = request_id
        self._handoff = handoff
        self._handoff_s = handoff_s
        self._sent = sent  # perf_counter: decode request sent
        self._began = began  # monotonic: the request reached this route (prefill included)
        self._ttft: float | None = None
        self._first_seen = False
        self._ended = False
        self.relayed = getattr(inner, "relayed", None)

    def _saw(self, batch: list[OutEvent]) -> None:
        for event in batch:
            event.resolve()
            if event.content:
                self._first_seen = True
                self._ttft = time.perf_counter() - self._sent
                self._router.note_first_content(self._member, self._ttft)
                return
            if event.error or event.done or event.malformed:
                self._first_seen = True  # no first-token timeout applies past this point
                return

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        failure: BaseException | None = None
        try:
            async for batch in self._inner:
                if not self._first_seen:
                    self._saw(batch)
                yield batch
        except Exception as exc:  # an UpstreamError, aiohttp's payload errors: the server broke
            failure = exc
            raise
        finally:
            self._end(failure or self._timed_out())

    def _end(self, failure: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._router.note_end(self._member, failure)
        self._router._report(
            self._request_id,
            self._member,
            self._handoff,
            self._handoff_s,
            self._ttft,
            failure is not None,
        )

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._inner.aclose()
        self._end(self._timed_out())

    def _timed_out(self) -> UpstreamError | None:
        """Closed without a first event once the route's first-token timeout had passed: the
        proxy gave up on this decode server, which counts as its failure."""
        limit = self._router.route.first_token_timeout_s
        if self._first_seen or limit is None or time.monotonic() - self._began < 0.95 * limit:
            return None
        return UpstreamError("no first token in time", status=504)


async def _prepared(body: UpstreamBody, ctx: CallContext) -> tuple[UpstreamBody, CallContext]:
    """The body as a dict both steps can rewrite (a big body comes encoded: parsed off the
    event loop) and a context that sends the request id to both servers as `X-Request-Id`,
    the id vLLM's connectors use to pair the two steps."""
    if isinstance(body, EncodedBody):
        # orjson wrote it from the dict the policies left, so it parses back to a dict
        body = await asyncio.to_thread(orjson.loads, body.encoded)
    headers = {**ctx.forward_headers, "x-request-id": ctx.request_id}
    return body, replace(ctx, forward_headers=headers)


def _pool(
    route: Route,
    replicas: Sequence[Replica],
    upstreams: Sequence[OpenAIUpstream],
    policy: HealthPolicy,
) -> dict[str, Member]:
    members = {}
    for name, replica, upstream in zip(pool_names(replicas), replicas, upstreams, strict=True):
        state = ReplicaState(
            name=name,
            weight=replica.weight,
            index=PrefixIndex(route.affinity_index_bytes),
            health=ReplicaHealth(policy),
        )
        members[name] = Member(upstream, state, PDServerStats())
    return members


def _by_health(members: list[Member]) -> list[Member]:
    now = time.monotonic()
    return sorted(members, key=lambda m: not m.state.health.healthy(now))


def _mean_ms(total_s: float, count: int) -> float | None:
    return round(1000 * total_s / count, 3) if count else None


def _server(name: str, member: Member, now: float, role: str) -> dict[str, Any]:
    state, stats = member.state, member.stats
    assert isinstance(stats, PDServerStats)
    mean = _mean_ms(stats.ttft_sum_s, stats.ttft_count)
    return {
        "name": name,
        "role": role,
        "state": state.health.state(now),
        "in_flight": state.in_flight,
        "queue": state.queue,
        "kv_usage": state.kv_usage,
        "ejections": state.health.ejections,
        "requests": stats.requests,
        "affinity_hits": stats.affinity_hits,
        "errors": stats.errors,
        "remote_prefills": stats.remote_prefills,
        # prefill: the prefill step's latency; decode: time to first content
        "upstream_ttft_mean_ms": mean,
    }
