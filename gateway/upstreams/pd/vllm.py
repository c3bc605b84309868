"""vLLM's prefill/decode pairing, for routes with `pd.protocol: vllm` (the default).

The two servers of a request are paired by a handoff, in three steps (`gateway.upstreams.pd.wire`
has their wire format): the prefill server is asked for one token and keeps the prompt's KV, its
answer's `kv_transfer_params` say where the blocks are, and the client's own request goes to a
decode server with them, which pulls the blocks and generates. Nothing goes to the decode server
before the prefill server answered, so a failed prefill only costs its own time.

A prefill step that leaves no usable `kv_transfer_params` sends the request colocated (see
`gateway.upstreams.pd.router`). A decode step that fails while pulling KV is tried once more,
colocated, on another decode server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from gateway.upstreams.base import CallContext, Completed, EventStream, UpstreamBody, UpstreamError
from gateway.upstreams.pd.router import Handoff, PrefillFailed
from gateway.upstreams.pd.wire import decode_body, kv_params_from, prefill_body

if TYPE_CHECKING:
    from gateway.upstreams.pd.router import PDUpstream
    from gateway.upstreams.replicas.balancer import Choice

log = logging.getLogger("firsttoken.pd")
T = TypeVar("T")


class VLLMPairing:
    """The `vllm` protocol's requests on a `PDUpstream`'s pools and counters."""

    def __init__(self, router: PDUpstream) -> None:
        self.router = router

    async def aclose(self) -> None:
        """Nothing outlives a request: each one's prefill step is over before its decode."""

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        router = self.router
        handoff = await self._prefill(body, ctx)
        return await self._decode(
            handoff,
            lambda choice, h: router.complete_on(choice, decode_body(body, h.params), ctx, h),
        )

    async def open_stream(self, body: UpstreamBody, ctx: CallContext, began: float) -> EventStream:
        router = self.router
        handoff = await self._prefill(body, ctx)
        return await self._decode(
            handoff,
            lambda choice, h: router.stream_on(choice, decode_body(body, h.params), ctx, h, began),
        )

    async def _prefill(self, body: UpstreamBody, ctx: CallContext) -> Handoff:
        """Steps 1 and 2: the prefill server's `kv_transfer_params`, or why there are none."""
        router = self.router
        request = prefill_body(body)
        picked = router.send_prefill(body, ctx)
        if picked is None:
            return router.colocated(None, "no_prefill_server")
        member, name = picked
        started = time.perf_counter()
        try:
            result = await router.run_prefill(member, member.upstream.complete(request, ctx))
        except PrefillFailed as failed:
            return router.colocated(name, failed.reason)
        answered = time.perf_counter()
        seconds = answered - started
        # Timed whatever it left: a prefill that ends colocated was time spent all the same,
        # and the operator sees it in the step timings (`firsttoken_pd_step_seconds`).
        router.note_prefill(member, seconds)
        params = kv_params_from(result.body)
        if params is None:
            log.warning(
                "route %s: prefill server %s answered without kv_transfer_params "
                "(is it started with a KV connector?)",
                router.route.name,
                name,
            )
            colocated = router.colocated(name, "no_kv_params")
            colocated.prefill_s = seconds
            return colocated
        return Handoff(params, name, None, answered, seconds)

    async def _decode(self, handoff: Handoff, call: Callable[[Choice, Handoff], Awaitable[T]]) -> T:
        """Step 3: `call` on the least loaded decode server; a failure of a request that carried
        kv_transfer_params is tried once more, colocated, on another server if there is one."""
        router = self.router
        first = router.choose_decode()
        if handoff.params is None:
            return await call(first, handoff)
        try:
            return await call(first, handoff)
        except UpstreamError as exc:
            log.info(
                "route %s: decode server %s failed a remote prefill (%s); decoding colocated",
                router.route.name,
                first.replica.name,
                exc.status,
            )
        colocated = router.colocated(handoff.prefill_server, "handoff_failed")
        return await call(router.choose_decode(frozenset({first.replica.name})), colocated)
