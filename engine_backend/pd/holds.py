"""KV held by a prefill server for a decode server to pull: reservations, pins, timeouts.

A request that asks for remote decode reserves its prompt's full blocks when it is added
(so a full server says 503 before spending a prefill on it). When it finishes, those blocks
are pinned under its transfer id: pinned blocks are never handed out, so their contents
stay exactly what the prefill computed. A hold ends when the decode server pulls it, when
its deadline passes (the router or the decode server gave up), or on shutdown. Everything
here runs on the engine thread; nothing locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_backend.block_manager import BlockManager
from engine_backend.sequence import Sequence


class KVHoldLimitError(RuntimeError):
    """Holding this request's blocks would pass the bound on held blocks (the server
    answers 503, and the router serves the request colocated)."""


@dataclass
class KVHold:
    """The pinned full blocks of one prompt, in order, and the tokens they hold."""

    transfer_id: str
    block_ids: list[int]
    token_ids: list[int]  # len(block_ids) * block_size tokens
    deadline: float


def num_transfer_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The full blocks a decode server can use: never the one holding the prompt's last
    token, which it recomputes to get logits to sample from."""
    return (num_prompt_tokens - 1) // block_size


class KVHolds:
    """Reservations and holds of one engine, bounded by `max_blocks` in total."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_blocks: int,
        hold_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_manager = block_manager
        self.max_blocks = max_blocks
        self.hold_s = hold_s
        self.clock = clock
        self.reserved: dict[str, int] = {}
        self.holds: dict[str, KVHold] = {}
        self.num_expired = 0

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self.holds.values())

    @property
    def num_reserved_blocks(self) -> int:
        return sum(self.reserved.values())

    def reserve(self, transfer_id: str, num_blocks: int) -> None:
        """Count `num_blocks` against the bound now; raises KVHoldLimitError past it."""
        if transfer_id in self.reserved or transfer_id in self.holds:
            raise ValueError(f"transfer id {transfer_id!r} is already in use")
        used = self.num_held_blocks + self.num_reserved_blocks
        if used + num_blocks > self.max_blocks:
            raise KVHoldLimitError(
                f"holding {num_blocks} more blocks would pass the bound of {self.max_blocks} "
                f"held blocks ({used} held or reserved)"
            )
        self.reserved[transfer_id] = num_blocks

    def unreserve(self, transfer_id: str) -> None:
        """The request ended without a hold (aborted, failed)."""
        self.reserved.pop(transfer_id, None)

    def hold(self, transfer_id: str, seq: Sequence) -> KVHold | None:
        """Pin `seq`'s transferable blocks under `transfer_id` (call before its blocks are
        freed). None when it has no full block to transfer."""
        self.reserved.pop(transfer_id, None)
        size = self.block_manager.block_size
        count = num_transfer_blocks(seq.num_prompt_tokens, size)
        if count <= 0:
            return None
        block_ids = list(seq.block_table[:count])
        self.block_manager.pin(block_ids)
        hold = KVHold(
            transfer_id, block_ids, list(seq.token_ids[: count * size]), self.clock() + self.hold_s
        )
        self.holds[transfer_id] = hold
        return hold

    def take(self, transfer_id: str) -> KVHold | None:
        """Remove a hold to serve it; the caller copies its blocks, then calls `release`."""
        return self.holds.pop(transfer_id, None)

    def release(self, hold: KVHold) -> None:
        self.block_manager.unpin(hold.block_ids)

    def expire(self) -> int:
        """Free the holds whose deadline passed; returns how many."""
        if not self.holds:
            return 0
        now = self.clock()
        expired = [h for h in self.holds.values() if h.deadline <= now]
        for hold in expired:
            del self.holds[hold.transfer_id]
            self.release(hold)
        self.num_expired += len(expired)
        return len(expired)

    def release_all(self) -> None:
        for hold in list(self.holds.values()):
            self.release(hold)
        self.holds.clear()
        self.reserved.clear()
