"""Prefixes a replica is computing right now, so that a request sharing one waits for it.

A prefix-caching engine caches a prompt's blocks once it has computed them, at the request's
first token. Until then a second request with the same beginning, sent to the same replica,
computes the same blocks again: a tenant's conversations that start together (an agent's
parallel calls, a burst after a deploy) each pay the whole shared prefix, on one replica,
side by side. The balancer sends them there anyway (its index holds a prefix from the moment it
is sent), so the cheapest thing for the later ones is to wait for the first one's first token
and then compute only what is their own: their first token comes no later than if they had
computed it all (the earlier request has a head start), and the engine computes the prefix
once.

`PrefixWarming` holds, per replica, the blocks each streaming request is computing (those its
replica was not already thought to hold) until that request's first token or its end. A request
whose matched prefix ends in a block still being computed waits for it, at most as long as
recomputing that much would take (the route's fitted prefill rate), and never after the
computing request failed or ended without a first token: then it goes on at once and computes
the prefix itself. Bounded: a request registers at most `MAX_BLOCKS` blocks, and the entries go
when their request's first token or end comes (or, should neither ever be reported, once they
are `max_age_s` old: nobody waits on them then).

Only streamed requests register: a whole answer's first token is not seen until its end. Any
request may wait for a streamed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

MAX_BLOCKS = 4096  # blocks one request registers (256-character blocks: 1 MiB of prompt)
MIN_WAIT_BLOCKS = 2  # a match of fewer still-warming blocks recomputes in a few milliseconds
MAX_AGE_S = 300.0


class Warming:
    """One request's blocks being computed on one replica."""

    __slots__ = ("done", "keys", "replica", "started")

    def __init__(self, replica: str, keys: list[bytes]) -> None:
        self.replica = replica
        self.keys = keys
        self.started = time.monotonic()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class PrefixWarming:
    """What each replica of a route is computing (see the module docstring)."""

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._by_block: dict[tuple[str, bytes], Warming] = {}
        self.waits = 0  # requests that waited for another's prefix
        self.waited_s = 0.0

    def __len__(self) -> int:
        return len(self._by_block)

    def start(self, replica: str, blocks: list[bytes], matched: int) -> Warming | None:
        """A request is sent to `replica` with `blocks`, of which the first `matched` were
        thought held there: it computes the rest. None when it computes nothing new."""
        by_block = self._by_block
        new = [b for b in blocks[matched : matched + MAX_BLOCKS] if (replica, b) not in by_block]
        if not new:
            return None
        warming = Warming(replica, new)
        for block in new:
            by_block[(replica, block)] = warming
        return warming

    def finish(self, warming: Warming | None) -> None:
        """The request's first token came, or it ended: its blocks are cached, or never will
        be by it. Idempotent."""
        if warming is None or warming.done.done():
            return
        warming.done.set_result(None)
        replica = warming.replica
        for block in warming.keys:
            key = (replica, block)
            if self._by_block.get(key) is warming:
                del self._by_block[key]

    def pending(self, replica: str, blocks: list[bytes], matched: int) -> Warming | None:
        """The request computing the last of the first `matched` blocks on `replica`, if that
        is still under way and enough of the match is."""
        if matched < MIN_WAIT_BLOCKS:
            return None
        warming = self._by_block.get((replica, blocks[matched - 1]))
        if warming is None:
            return None
        if time.monotonic() - warming.started > self.max_age_s:
            self.finish(warming)
            return None
        if self._by_block.get((replica, blocks[matched - MIN_WAIT_BLOCKS])) is not warming:
            return None
        return warming

    async def wait(self, warming: Warming, limit_s: float) -> None:
        """Wait for `warming`'s first token or end, at most `limit_s` seconds."""
        if limit_s <= 0 or warming.done.done():
            return
        started = asyncio.get_running_loop().time()
        self.waits += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(warming.done), limit_s)
        finally:
            self.waited_s += asyncio.get_running_loop().time() - started
