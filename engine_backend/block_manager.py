"""The KV block pool and the prefix cache over it.

The pool is a fixed set of block ids, allocated once; a sequence owns a block
table that lists which blocks hold its tokens. Full blocks are named by a hash
chain (the hash of a block covers every token before it, and the tenant's salt),
so two prompts that share a prefix share its blocks. Blocks carry reference
counts; a block nobody references stays in the cache but sits in an LRU free
queue, where it is still a hit until the pool needs it for something else.
Free blocks with no hash are handed out first, then the least recently used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as SequenceLike

from engine_backend.sequence import Sequence


def hash_block(parent: bytes, token_ids: SequenceLike[int]) -> bytes:
    """128-bit name for a block given its parent's name: collisions are negligible,
    and lookups still compare the block's tokens before trusting a hit."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def chain_root(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: tenants with different salts never meet."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"salt:" + cache_salt.encode(), digest_size=16).digest()


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Hands out KV blocks to sequences and remembers full blocks for reuse."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in eviction order (front goes first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self.free_blocks)

    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = seq.block_hashes
        size = self.block_size
        parent = hashes[-1] if hashes else chain_root(seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, seq.token_ids[i * size : (i + 1) * size])
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold a prefix of `seq`, never covering its last token
        (that one is recomputed so the step has logits to sample from)."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        max_blocks = (len(seq) - 1) // size
        hits: list[int] = []
        for i, block_hash in enumerate(self._ensure_hashes(seq, max_blocks)[:max_blocks]):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * size : (i + 1) * size]):
                break
            hits.append(block_id)
        return hits

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int) -> int:
        if num_hit_blocks:
            num_tokens = num_hit_blocks * self.block_size + num_new_tokens
            have = num_hit_blocks
        else:
            num_tokens = seq.num_computed_tokens + num_new_tokens
            have = len(seq.block_table)
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit_blocks: SequenceLike[int] = ()
    ) -> bool:
        """Whether `num_new_tokens` more tokens of `seq` fit (hits taken from the free
        queue count against it, since they stop being evictable)."""
        reclaimed = sum(1 for b in hit_blocks if self.blocks[b].ref_count == 0)
        needed = self._num_new_blocks(seq, num_new_tokens, len(hit_blocks))
        return needed + reclaimed <= len(self.free_blocks)

    def allocate(
        self, seq: Sequence, num_new_tokens: int, hit_blocks: SequenceLike[int] = ()
    ) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens; on first
        admission, `hit_blocks` become its leading blocks (the scheduler counts their
        tokens as computed)."""
        if hit_blocks:
            assert not seq.block_table, "prefix hits only apply to a sequence with no blocks"
        needed = self._num_new_blocks(seq, num_new_tokens, len(hit_blocks))
        for block_id in hit_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if hit_blocks:
            seq.num_registered_blocks = len(hit_blocks)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s newly completed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = seq.num_computed_tokens // size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_hash = hashes[i]
            if block_hash in self.cached_blocks:
                continue  # an identical block computed concurrently already holds this name
            block = self.blocks[seq.block_table[i]]
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
            self.cached_blocks[block_hash] = block.block_id
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Cached ones stay findable; the tail of the sequence
        is queued for eviction before its head, and unnamed blocks before both."""
        self.unpin(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0
        self.unpin(seq.pinned_blocks)
        seq.pinned_blocks = []

    def pin(self, block_ids: SequenceLike[int]) -> None:
        """Take one more reference on each block: a pinned block is never handed out (its
        contents cannot change) until `unpin`. Used to hold KV for a transfer."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1

    def unpin(self, block_ids: SequenceLike[int]) -> None:
        """Drop one reference on each block (the tail first, so a sequence's head is
        evicted last); unnamed blocks are queued to be handed out before cached ones."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    def claim_prefix(
        self, seq: Sequence, num_blocks: int
    ) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Pin blocks for `seq`'s first `num_blocks` full blocks so that its admission finds
        them all as prefix-cache hits: blocks already cached are reused, the others are
        taken from the free queue, unnamed until `name_block` says their KV is in place (so no
        other request can hit a block that is still being filled).

        Returns (the pinned block ids in order, (block index, block id) of each fresh block,
        which the caller fills with KV and then names), or None when the pool has too few
        free blocks (nothing changed then). The caller keeps the pins in `seq.pinned_blocks`;
        the scheduler drops them at admission or finish.
        """
        if not self.enable_prefix_caching or num_blocks <= 0:
            return None
        size = self.block_size
        hashes = self._ensure_hashes(seq, num_blocks)
        plan: list[int | None] = []
        for i in range(num_blocks):
            cached = self.cached_blocks.get(hashes[i])
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            if cached is not None and self.blocks[cached].token_ids != tokens:
                return None  # a hash collision: never mix two prompts' KV
            plan.append(cached)
        reused = [b for b in plan if b is not None]
        reclaimed = sum(1 for b in reused if self.blocks[b].ref_count == 0)
        if plan.count(None) > len(self.free_blocks) - reclaimed:
            return None
        self.pin(reused)
        pinned: list[int] = []
        fresh: list[tuple[int, int]] = []
        for i, cached in enumerate(plan):
            if cached is None:
                cached = self._take_free_block()
                fresh.append((i, cached))
            pinned.append(cached)
        return pinned, fresh

    def name_block(self, seq: Sequence, index: int, block_id: int) -> None:
        """Publish a claimed block, now holding the KV of `seq`'s block `index`, under `seq`'s
        hash chain. If an identical block took that name meanwhile, this one stays unnamed
        (and is freed with the pins): the sequence's admission finds the other."""
        if not self.enable_prefix_caching:
            return
        block_hash = self._ensure_hashes(seq, index + 1)[index]
        if block_hash in self.cached_blocks:
            return
        size = self.block_size
        block = self.blocks[block_id]
        block.block_hash = block_hash
        block.token_ids = tuple(seq.token_ids[index * size : (index + 1) * size])
        self.cached_blocks[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use keep their data, just not their names)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached_blocks.clear()
