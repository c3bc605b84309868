"""SGLang's prefill/decode protocol, for routes with `pd.protocol: sglang`.

SGLang pairs the two servers of a request by a meeting point rather than by a handoff: the
request carries `bootstrap_host` and `bootstrap_port` (where the prefill server's bootstrap
service listens, `--disaggregation-bootstrap-port`) and a `bootstrap_room` that both servers
use to find each other's half of it. The same request goes to both servers at once: the
prefill server computes the KV and pushes it to the decode server once that one has joined
the room, so sending the two one after the other would leave the first waiting for its peer.
The decode server answers the client; the prefill server's answer only says whether its part
went well, and is read to the end and dropped.

A failed prefill (an error answer, a broken connection, no answer within the route's
`pd.prefill_timeout_s`) leaves the decode server waiting for KV that never comes, so the
router gives up on that decode request as soon as it knows and sends the request colocated
(no bootstrap fields) to a decode server. That is only possible while the client has seen
nothing, which is why a stream is read up to its first content before it is handed on. A
decode server that fails a paired request (an error answer or an in-stream error before any
content) is given the request once more, colocated, on another decode server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from gateway.config.routes import Replica, pool_names
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EventStream,
    UpstreamBody,
    UpstreamError,
)
from gateway.upstreams.pd.router import Handoff, PDStream, PrefillFailed

if TYPE_CHECKING:
    from gateway.upstreams.pd.router import PDUpstream
    from gateway.upstreams.replicas.balancer import Choice
    from gateway.upstreams.replicas.pool import Member

log = logging.getLogger("firsttoken.pd")
T = TypeVar("T")

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ROOM_BITS = 63  # rooms are non-negative signed 64-bit integers on SGLang's side


def new_room() -> int:
    """A room no other request in flight uses (random: gateways share no counter)."""
    return secrets.randbits(ROOM_BITS)


def bootstrap_params(prefill: Replica, room: int) -> dict[str, Any]:
    """The fields that send a request's KV from `prefill` through `room`."""
    return {
        "bootstrap_host": urlsplit(prefill.base_url).hostname,
        "bootstrap_port": prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
        "bootstrap_room": room,
    }


def decode_body(body: UpstreamBody, params: dict[str, Any] | None) -> UpstreamBody:
    """The request both servers get: the client's, with `params` (None: an ordinary request)
    in place of any bootstrap fields the client sent, which must not steer where KV goes."""
    out = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
    if params is not None:
        out.update(params)
    return out


class NoAnswer(Exception):
    """A paired decode stream ended or failed before its first content."""


class SGLangPairing:
    """The `sglang` protocol's requests on a `PDUpstream`'s pools and counters."""

    def __init__(self, router: PDUpstream) -> None:
        self.router = router
        pd = router.pd
        self.replicas = dict(zip(pool_names(pd.prefill), pd.prefill, strict=True))
        self._drains: set[asyncio.Task[str | None]] = set()  # prefill answers still read

    async def aclose(self) -> None:
        for task in self._drains:
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        router = self.router

        async def call(choice: Choice, handoff: Handoff) -> Completed:
            return await router.complete_on(choice, decode_body(body, handoff.params), ctx, handoff)

        return await self._paired(body, ctx, call, _nothing)

    async def open_stream(self, body: UpstreamBody, ctx: CallContext, began: float) -> EventStream:
        router = self.router

        async def call(choice: Choice, handoff: Handoff) -> PDStream:
            stream = await router.stream_on(
                choice, decode_body(body, handoff.params), ctx, handoff, began
            )
            if handoff.params is None:
                return stream
            try:
                answered = await stream.prefetch_first()
            except Exception as exc:  # a broken stream: the server's fault, the client saw nothing
                await stream.abandon(exc)
                raise NoAnswer(f"decode stream broke ({type(exc).__name__})") from exc
            except BaseException:
                await stream.abandon(None)
                raise
            if not answered:  # an error event, maybe the KV transfer's: not held against it
                await stream.abandon(None)
                raise NoAnswer("decode stream ended without content")
            return stream

        return await self._paired(body, ctx, call, _close_stream)

    async def _paired(
        self,
        body: UpstreamBody,
        ctx: CallContext,
        call: Callable[[Choice, Handoff], Awaitable[T]],
        discard: Callable[[T], Awaitable[None]],
    ) -> T:
        """`call` on a decode server with the prefill server's bootstrap fields while the
        prefill server gets the same request; colocated when either side fails first."""
        router = self.router
        picked = router.send_prefill(body, ctx)
        if picked is None:
            return await call(router.choose_decode(), router.colocated(None, "no_prefill_server"))
        member, name = picked
        params = bootstrap_params(self.replicas[name], new_room())
        handoff = Handoff(params, name, concurrent=True)
        drain = asyncio.create_task(self._drain(member, handoff, decode_body(body, params), ctx))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)

        first = router.choose_decode()
        attempt = asyncio.ensure_future(call(first, handoff))
        try:
            await asyncio.wait({attempt, drain}, return_when=asyncio.FIRST_COMPLETED)
            if not attempt.done() and _outcome(drain) is None:
                await asyncio.wait({attempt})  # the KV is on its way: the decode will answer
        except BaseException:  # the client left: neither server works for it any longer
            drain.cancel()
            await _abandon(attempt, discard)
            raise
        if attempt.done():
            failure = attempt.exception()
            if failure is None:
                return attempt.result()
            prefill_failed = _outcome(drain) if drain.done() else None
            drain.cancel()  # KV for a decode request that is over would go nowhere
            if not isinstance(failure, UpstreamError | NoAnswer):
                raise failure
            reason = prefill_failed or "handoff_failed"
            log.info(
                "route %s: decode server %s failed a paired request (%s); decoding colocated",
                router.route.name,
                first.replica.name,
                failure,
            )
        else:  # the prefill failed first: the decode server would wait for KV in vain
            reason = _outcome(drain) or "prefill_error"
            await _abandon(attempt, discard)
        exclude = frozenset({first.replica.name}) if reason == "handoff_failed" else frozenset()
        colocated = router.colocated(name, reason)
        return await call(router.choose_decode(exclude), colocated)

    async def _drain(
        self, member: Member, handoff: Handoff, body: UpstreamBody, ctx: CallContext
    ) -> str | None:
        """Read the prefill server's answer to the end: None when it went well, else why
        the request should go colocated (one of `FALLBACK_REASONS`)."""
        started = time.perf_counter()
        try:
            await self.router.run_prefill(member, _answer(member, body, ctx))
        except PrefillFailed as failed:
            return failed.reason
        seconds = time.perf_counter() - started
        self.router.note_prefill(member, seconds)
        handoff.prefill_s = seconds
        return None


async def _answer(member: Member, body: UpstreamBody, ctx: CallContext) -> None:
    """The prefill server's answer, read to its end and dropped."""
    if body.get("stream"):
        await _read_out(await member.upstream.open_stream(body, ctx))
    else:
        await member.upstream.complete(body, ctx)


async def _read_out(stream: EventStream) -> None:
    """Read a prefill server's stream to its end; an in-stream error is its failure."""
    try:
        async for batch in stream:
            for event in batch:
                event.resolve()
                if event.error or event.malformed:
                    raise UpstreamError("prefill server sent an error event", status=502)
    finally:
        await stream.aclose()


def _outcome(drain: asyncio.Task[str | None]) -> str | None:
    """A finished drain's reason to go colocated (a drain cancelled at shutdown: an error)."""
    if drain.cancelled():
        return "prefill_error"
    return drain.result()


async def _abandon(attempt: asyncio.Future[T], discard: Callable[[T], Awaitable[None]]) -> None:
    """Stop a decode attempt nobody will read; one that finished anyway is discarded."""
    attempt.cancel()
    await asyncio.wait({attempt})
    if not attempt.cancelled() and attempt.exception() is None:
        await discard(attempt.result())


async def _nothing(_: Completed) -> None:
    return None


async def _close_stream(stream: PDStream) -> None:
    await stream.abandon(None)
