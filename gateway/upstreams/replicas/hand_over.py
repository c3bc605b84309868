"""A slow replica's warm conversations hand their tenant's shared prefix to the replica that
the tenant's next conversation will take.

When a replica turns slow, the balancer stops sending it new conversations (each would pay its
excess on every turn) while its warm conversations stay (they already hold their prefix
there). Every tenant whose prefix lived on it then pays one recompute of the shared part, its
system prompt and tools, in the first turn of its next conversation elsewhere: for a long
prompt the slowest first token of the slowdown. But a conversation still going on at the slow
replica carries that prefix in each of its requests; so, the first time one of them goes there
while a new conversation with its prefix would go elsewhere, the gateway sends the prefix to
that other replica as a one-token completion in the background. The prefill then happens in
a free slot before the tenant's next conversation comes, instead of in its first turn.

Bounded: only a prefix of at least `MIN_BLOCKS` blocks (a shorter one recomputes in a few
milliseconds), only to a replica with a slot free that holds less than half of it, at most
`PER_TARGET` hand-overs at once to each replica (a replica spends at most that many slots on
them); the target's prefix index holds the prefix from the moment it is sent, so each is sent
once (again only if the target has since evicted it). A hand-over is not a client's request:
it has no telemetry record, and its answer gives the balancer no first-token or slot-time
sample (a one-token answer would make the target look fast); a failure counts against the
target as any request's would. The body is the request's own leading system (or developer)
messages, its tools and its first user message (some chat templates refuse a prompt without
one), sent to a replica of the route the tenant's requests go to anyway.

What it cannot cover: a tenant with no conversation going on at the slow replica once it reads
as slow (nothing carries its prefix), and a prefix the target evicts before the tenant's next
conversation comes (a cache smaller than the working set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from gateway.upstreams.base import CallContext, UpstreamBody
from gateway.upstreams.replicas.balancer import Choice, ReplicaState
from gateway.upstreams.replicas.prefix_index import BLOCK_CHARS, prompt_text

if TYPE_CHECKING:
    from gateway.upstreams.replicas.pool import Member, ServerPool
    from gateway.upstreams.replicas.shared_index import SharedPlacements

log = logging.getLogger("firsttoken.replicas")

MIN_BLOCKS = 4  # 1 KiB of prompt, ~256 tokens
PER_TARGET = 1
TIMEOUT_S = 60.0
LEADING_ROLES = frozenset({"system", "developer"})


def shared_prefix(body: UpstreamBody) -> tuple[dict[str, Any], int] | None:
    """The hand-over body for a chat request, and the length in `prompt_text` characters of
    the prefix it shares with the tenant's other conversations (its tools and leading system
    messages). None when the request has no such prefix or no user message right after it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    lead = 0
    while (
        lead < len(messages)
        and isinstance(messages[lead], dict)
        and messages[lead].get("role") in LEADING_ROLES
    ):
        lead += 1
    if not lead or lead == len(messages):
        return None
    first_user = messages[lead]
    if not isinstance(first_user, dict) or first_user.get("role") != "user":
        return None
    prefix: dict[str, Any] = {"messages": messages[:lead]}
    hand_over: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [*messages[:lead], first_user],
        "max_tokens": 1,
        "stream": False,
    }
    tools = body.get("tools")
    if tools:
        prefix["tools"] = hand_over["tools"] = tools
    return hand_over, len(prompt_text(prefix))


@dataclasses.dataclass
class HandOverCounts:
    sent: int = 0
    failed: int = 0
    # due but not sent: the target had no slot free (the prefill must not queue behind
    # clients' requests), or `PER_TARGET` were under way to it; a later request may send it
    deferred_busy: int = 0
    deferred_limit: int = 0


class PrefixHandOver:
    """One route's hand-overs (see the module docstring): `consider` each request that went to
    a replica measured slow."""

    def __init__(self, pool: ServerPool, route_name: str) -> None:
        self.pool = pool
        self.route_name = route_name
        self.counts = HandOverCounts()
        self._tasks: set[asyncio.Task] = set()
        self._to: dict[str, int] = {}  # hand-overs under way, by target

    def consider(
        self,
        body: UpstreamBody,
        ctx: CallContext,
        origin: ReplicaState,
        blocks: list[bytes],
        now: float,
        placements: SharedPlacements | None = None,
    ) -> None:
        """Hand the shared prefix of `body` (whose prompt hashed to `blocks`, going to the slow
        `origin`) over to where its tenant's next conversation would go, if anywhere."""
        if ctx.endpoint != "chat":
            return
        found = shared_prefix(body)
        if found is None:
            return
        hand_over, prefix_chars = found
        prefix = blocks[: prefix_chars // BLOCK_CHARS]
        if len(prefix) < MIN_BLOCKS:
            return
        balancer = self.pool.balancer
        target = balancer.hand_over_target(origin, prefix, prefix_chars, now)
        if target is None:
            return
        if balancer.wait_ms(target) > 0:
            self.counts.deferred_busy += 1
            return
        if self._to.get(target.name, 0) >= PER_TARGET:
            self.counts.deferred_limit += 1
            return
        choice = Choice(target, target.index.matched(prefix), len(prefix), "hand_over")
        member = self.pool.sent(choice, prefix, placements)
        self.counts.sent += 1
        log.info(
            "route %s: handing a %d-block prefix over from %s to %s",
            self.route_name,
            len(prefix),
            origin.name,
            target.name,
        )
        call_ctx = dataclasses.replace(ctx, request_id=f"{ctx.request_id}.hand-over", hedged=False)
        task = asyncio.ensure_future(self._send(member, hand_over, call_ctx))
        self._tasks.add(task)
        self._to[target.name] = self._to.get(target.name, 0) + 1
        task.add_done_callback(functools.partial(self._done, member, ctx.tenant))

    async def _send(
        self, member: Member, body: UpstreamBody, ctx: CallContext
    ) -> BaseException | None:
        """The hand-over's failure, if it failed (its accounting is `_done`'s)."""
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await member.upstream.complete(body, ctx)
        except Exception as exc:  # noqa: BLE001  # judged as any request's failure, in _done
            log.info(
                "route %s: hand-over to %s failed: %s",
                self.route_name,
                member.state.name,
                type(exc).__name__,
            )
            return exc
        return None

    def _done(self, member: Member, tenant: str, task: asyncio.Task) -> None:
        """Free the target's slot however the hand-over ended (a task cancelled before its
        first step never ran `_send` at all) and judge the target as for any request."""
        self._tasks.discard(task)
        self._to[member.state.name] -= 1
        if task.cancelled():
            self.pool.balancer.done(member.state)
            return
        failure = task.result()
        if failure is not None:
            self.counts.failed += 1
        self.pool.ended(member, failure, tenant)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
