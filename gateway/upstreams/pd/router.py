"""A `pd` route: prefill and decode servers behind one `Upstream`.

Each request is prefilled on the prefill server most likely to hold its prefix (the same prefix
affinity as replicated routes: a prefill server's cache is what saves compute), then decoded on
the least loaded decode server (decode is memory-bound: what matters there is how many streams
share it). Both pools eject a server that fails (its own failures, as on replicated routes; any
5xx to a prefill step counts, since the gateway wrote that request) and probe it back
(`gateway.upstreams.replicas.pool.ServerPool`).

PD is an optimisation, never a new way to fail: when the prefill step fails, times out, answers
503 (a prefill server out of room for held blocks) or leaves nothing the decode server could
use, or when every prefill server is ejected, the request goes to a decode server as an ordinary
request. Only a decode server failing an ordinary request is the request's failure (the proxy
then retries or falls back as on any route).

How the two servers of a request are paired is the route's `pd.protocol`, a `Pairing` chosen
where the upstream is built (`gateway.upstreams.build`): vLLM's handoff, prefill first and its
answer's `kv_transfer_params` passed to the decode request (`gateway.upstreams.pd.vllm`), or
SGLang's bootstrap room, the same request sent to both at once (`gateway.upstreams.pd.sglang`).
This module is what both share: the choice of servers, the colocated fallback, the counters and
the decode streams. Per request the prefill step's latency, the handoff (prefill answer to decode
request) and the decode server's time to first content are kept apart, per server and per route
(`snapshot`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from gateway.config.routes import Route
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
from gateway.upstreams.replicas.balancer import Choice
from gateway.upstreams.replicas.pool import (
    Member,
    MemberStream,
    ReplicaStats,
    ServerPool,
    first_model_cards,
    mean_ms,
)
from gateway.upstreams.replicas.prefix_index import BlockChains, prompt_text

if TYPE_CHECKING:
    import aiohttp

    from gateway.paths import PassPath
    from gateway.upstreams.openai import OpenAIUpstream
    from gateway.upstreams.replicas.shared_index import SharedPlacements

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
    # sglang: both servers got the request at once, so there is no handoff to time, and
    # `params` are the bootstrap fields
    concurrent: bool = False


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


class PrefillFailed(Exception):
    """A prefill request that failed; `reason` (one of `FALLBACK_REASONS`) is why the request
    goes colocated."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Pairing(Protocol):
    """How a route pairs a request's prefill and decode servers (its `pd.protocol`), on the
    router's pools and counters. The router hands it each request once its body is a dict and
    its context carries the request id to both servers, and counts it."""

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed: ...

    async def open_stream(self, body: UpstreamBody, ctx: CallContext, began: float) -> EventStream:
        """`began` (monotonic): when the request reached the route, what the decode stream's
        first-token timeout counts from."""
        ...

    async def aclose(self) -> None: ...


class PDUpstream:
    """The `Upstream` of a route with `pd` (see the module docstring); `pairing` makes the
    route's `Pairing` on this router."""

    def __init__(
        self,
        route: Route,
        prefill: Sequence[OpenAIUpstream],
        decode: Sequence[OpenAIUpstream],
        pairing: Callable[[PDUpstream], Pairing],
    ) -> None:
        if route.pd is None:
            raise ValueError(f"route {route.name!r} has no pd pools")
        self.route = route
        self.pd = route.pd
        self.prefill = ServerPool(
            route,
            self.pd.prefill,
            prefill,
            "prefix_affinity",
            "prefill/",
            PDServerStats,
            own_requests=True,
        )
        self.decode = ServerPool(
            route, self.pd.decode, decode, "least_loaded", "decode/", PDServerStats
        )
        # One namespace for both pools ("prefill/<name>", "decode/<name>"): the shape
        # `FleetCollector`, `/readyz` and `SharedPlacements` read from a replicated route.
        self.members: dict[str, Member] = {**self.prefill.named(), **self.decode.named()}
        self.stats = PDStats()
        self.chains = BlockChains()  # a conversation's next turn hashes only what is new
        self.placements: SharedPlacements | None = None  # set when Redis shares the indexes
        self.on_request: Callable[[PDTiming], None] | None = None
        self.pairing = pairing(self)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), self.decode.start())

    async def warm_up(self) -> None:
        await asyncio.gather(self.prefill.warm_up(), self.decode.warm_up())

    async def aclose(self) -> None:
        await self.pairing.aclose()
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())

    # -- what the proxy calls ---------------------------------------------------------------

    async def model_cards(self) -> list[ModelCard]:
        return await first_model_cards(
            [*self.decode.members.values(), *self.prefill.members.values()]
        )

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """Passthrough paths go to the first healthy decode server in the configured order
        (decode servers are the ones that answer clients)."""
        member = self.decode.by_health()[0]
        return await member.upstream.forward(method, path, headers, data)

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> EventStream:
        body, ctx = await _prepared(body, ctx)
        began = time.monotonic()
        self.stats.requests += 1
        return await self.pairing.open_stream(body, ctx, began)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        body, ctx = await _prepared(body, ctx)
        self.stats.requests += 1
        return await self.pairing.complete(body, ctx)

    # -- the prefill server -----------------------------------------------------------------

    def send_prefill(self, body: UpstreamBody, ctx: CallContext) -> tuple[Member, str] | None:
        """The prefill server most likely to hold the prompt's prefix, counted as sent to, and
        its name; None when every prefill server failed recently (waiting on one again would
        only delay the colocated answer; the probe or the end of a backoff brings them back)."""
        seed = ctx.tenant if self.route.affinity_per_tenant else ""
        blocks = self.chains.blocks(prompt_text(body), seed)
        choice = self.prefill.choose(blocks)
        if choice.reason == "only_unhealthy":
            return None
        return self.prefill.sent(choice, blocks, self.placements), choice.replica.name

    async def run_prefill(self, member: Member, call: Awaitable[T]) -> T:
        """`call`, a request `send_prefill` sent to `member`, within the route's prefill timeout.
        Its end frees the server's slot; a failure counts against the server and is raised as
        `PrefillFailed`, since it is the request's reason to go colocated, not its failure."""
        try:
            async with asyncio.timeout(self.pd.prefill_timeout_s):
                result = await call
        except TimeoutError:
            self.prefill.ended(member, UpstreamError("prefill timed out", status=504))
            raise PrefillFailed("prefill_timeout") from None
        except UpstreamError as exc:
            self.prefill.ended(member, exc)
            busy = exc.status == 503 and exc.body is not None  # an answer, not a lost connection
            raise PrefillFailed("prefill_busy" if busy else "prefill_error") from exc
        except Exception as exc:  # a body cut short: this server broke, not the request
            self.prefill.ended(member, exc)
            raise PrefillFailed("prefill_error") from exc
        except BaseException:
            self.prefill.balancer.done(member.state)
            raise
        self.prefill.ended(member, None)
        return result

    def note_prefill(self, member: Member, seconds: float) -> None:
        """A prefill step that left the decode server what it needs took `seconds`."""
        self.prefill.note_ttft(member, seconds)
        self.stats.prefill_sum_s += seconds
        self.stats.prefill_count += 1

    def colocated(self, prefill_server: str | None, reason: str) -> Handoff:
        """The handoff of a request decoded without a remote prefill, counted for `reason`."""
        self.stats.colocated[reason] += 1
        return Handoff(None, prefill_server, reason)

    # -- the decode server ------------------------------------------------------------------

    def choose_decode(self, exclude: frozenset[str] = frozenset()) -> Choice:
        """The least loaded decode server, not one of `exclude` unless it is the only one."""
        try:
            return self.decode.choose([], exclude)
        except LookupError:  # a one-server pool: the same server again
            return self.decode.choose([])

    async def stream_on(
        self, choice: Choice, body: UpstreamBody, ctx: CallContext, handoff: Handoff, began: float
    ) -> PDStream:
        """`body`, the decode request for `handoff`, streamed from `choice`."""
        member, stream, sent, handoff_s = await self._on_decode(
            choice, handoff, lambda m: m.upstream.open_stream(body, ctx)
        )
        return PDStream(stream, self, member, ctx.request_id, handoff, handoff_s, sent, began)

    async def complete_on(
        self, choice: Choice, body: UpstreamBody, ctx: CallContext, handoff: Handoff
    ) -> Completed:
        """`body`, the decode request for `handoff`, answered by `choice`."""
        member, result, _, handoff_s = await self._on_decode(
            choice, handoff, lambda m: m.upstream.complete(body, ctx)
        )
        self.decode.ended(member, None)
        self._report(ctx.request_id, member, handoff, handoff_s, None, failed=False)
        return result

    async def _on_decode(
        self, choice: Choice, handoff: Handoff, send: Callable[[Member], Awaitable[T]]
    ) -> tuple[Member, T, float, float | None]:
        """`send` the decode step to `choice`: the server, its answer, when it was sent
        (perf_counter) and the handoff's seconds (prefill answer to decode request sent)."""
        member = self.decode.sent(choice, [], None)
        sent = time.perf_counter()
        # With kv_transfer_params, a decode server that answered an error may be failing to
        # pull from the prefill server: not its own fault, unless it did not answer at all.
        result = await self.decode.attempt(
            member, send(member), lambda exc: handoff.params is None or exc.body is None
        )
        if handoff.params is None:
            return member, result, sent, None
        assert isinstance(member.stats, PDServerStats)
        member.stats.remote_prefills += 1
        if handoff.concurrent:
            return member, result, sent, None
        seconds = sent - handoff.answered
        self.stats.handoff_sum_s += seconds
        self.stats.handoff_count += 1
        return member, result, sent, seconds

    def note_first_content(self, member: Member, seconds: float) -> None:
        self.decode.note_ttft(member, seconds)
        self.stats.decode_ttft_sum_s += seconds
        self.stats.decode_ttft_count += 1

    def note_end(self, member: Member, failed: BaseException | None) -> None:
        self.decode.ended(member, failed)

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
        prefill = self.prefill.rows(now, role="prefill")
        decode = self.decode.rows(now, role="decode")
        s = self.stats
        return {
            "mode": "pd",
            "prefill": prefill,
            "decode": decode,
            "pd": {
                "requests": s.requests,
                "colocated_fallbacks": sum(s.colocated.values()),
                "colocated_by_reason": dict(s.colocated),
                "prefill_ms_mean": mean_ms(s.prefill_sum_s, s.prefill_count),
                "handoff_ms_mean": mean_ms(s.handoff_sum_s, s.handoff_count),
                "decode_ttft_ms_mean": mean_ms(s.decode_ttft_sum_s, s.decode_ttft_count),
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


class PDStream(MemberStream):
    """A decode server's event stream that tells the router its first content and its end
    (once), and reports the request's steps at the end. Its first-token timeout counts from
    when the request reached the route (`began`, monotonic: prefill included)."""

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
        super().__init__(inner, member, router.route.first_token_timeout_s, began)
        self._router = router
        self._request_id = request_id
        self._handoff = handoff
        self._handoff_s = handoff_s
        self._sent = sent  # perf_counter: decode request sent
        self._ttft: float | None = None
        self._done = False  # saw [DONE]
        self.reported = True  # False: an attempt given up before the client saw it

    async def prefetch_first(self) -> bool:
        """Read up to the first content (kept for replay): whether the stream answered, with
        content or an orderly end, rather than an error or a stream cut short. Raises what
        the stream raises."""
        source = self._source()
        while not self._first_seen:
            try:
                batch = await source.__anext__()
            except StopAsyncIteration:
                break
            self._held.append(batch)
            self._saw(batch)
        return self._ttft is not None or self._done

    async def abandon(self, failure: BaseException | None) -> None:
        """Close a stream the client will never see: its server's slot is freed (judged by
        `failure`) and the request is not reported, since another attempt answers it."""
        self.reported = False
        self._end(failure)
        await self.aclose()

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
                self._done = event.done
                return

    def _finish(self, failure: BaseException | None) -> None:
        self._router.note_end(self._member, failure)
        if not self.reported:
            return
        self._router._report(
            self._request_id,
            self._member,
            self._handoff,
            self._handoff_s,
            self._ttft,
            failure is not None,
        )


async def _prepared(body: UpstreamBody, ctx: CallContext) -> tuple[UpstreamBody, CallContext]:
    """The body as a dict both steps can rewrite (a big body comes encoded: parsed off the
    event loop) and a context that sends the request id to both servers as `X-Request-Id`,
    the id vLLM's connectors use to pair the two steps."""
    if isinstance(body, EncodedBody):
        # orjson wrote it from the dict the policies left, so it parses back to a dict
        body = await asyncio.to_thread(orjson.loads, body.encoded)
    headers = {**ctx.forward_headers, "x-request-id": ctx.request_id}
    return body, replace(ctx, forward_headers=headers)
