"""The block pool and prefix cache on their own: hits, ref counts, LRU, isolation."""

from __future__ import annotations

from engine_backend.block_manager import BlockManager
from engine_backend.sampling import SamplingParams
from engine_backend.sequence import Sequence

PARAMS = SamplingParams()


def seq(tokens: list[int], salt: str | None = None, name: str = "s") -> Sequence:
    return Sequence(name, tokens, PARAMS, cache_salt=salt)


def admit_and_compute(bm: BlockManager, s: Sequence) -> list[int]:
    """Admit `s` whole (as the scheduler would with a large budget) and mark it computed."""
    hits = bm.find_cached_prefix(s)
    assert bm.can_allocate(s, len(s) - len(hits) * bm.block_size, hits)
    bm.allocate(s, len(s) - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = len(s)  # the scheduler's part: the step computed all of it
    bm.register_full_blocks(s)
    return hits


def test_allocation_covers_tokens_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    admit_and_compute(bm, s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_shared_prefix_hits_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(list(range(10)), name="a")
    admit_and_compute(bm, first)
    second = seq([*list(range(9)), 99], name="b")
    hits = admit_and_compute(bm, second)
    assert hits == first.block_table[:2]  # block 3 (tokens 8..9) is partial
    assert all(bm.blocks[b].ref_count == 2 for b in hits)
    exact = seq(list(range(8)), name="c")  # exactly two full blocks
    assert bm.find_cached_prefix(exact) == first.block_table[:1]  # the last token is recomputed


def test_hash_chain_depends_on_everything_before_the_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit_and_compute(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert bm.find_cached_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_collision_check_rejects_a_block_whose_tokens_differ():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)  # as if another prefix had the same hash
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_unreferenced_cached_blocks_count_as_free_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq([1, 2, 3], name="old"), seq([5, 6, 7], name="new")
    admit_and_compute(bm, old)
    admit_and_compute(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4
    assert bm.find_cached_prefix(seq([1, 2, 3])) and bm.find_cached_prefix(seq([5, 6, 7]))
    # Two unnamed blocks go first, then the least recently used cached block ("old").
    taker = seq([8, 8, 8, 8, 8, 8], name="taker")
    bm.allocate(taker, 6)
    assert bm.find_cached_prefix(seq([1, 2, 3])) == []
    assert bm.find_cached_prefix(seq([5, 6, 7])) != []
    bm.free(taker)
    assert bm.num_free_blocks == 4


def test_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 6])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    # Needs 3 blocks, 2 of which come from the free queue as hits: 1 new + 2 reclaimed <= 4.
    assert bm.can_allocate(b, 1, hits)
    bm.allocate(b, 1, hits)
    assert bm.num_free_blocks == 1
    assert b.block_table[:2] == hits and b.num_registered_blocks == 2
    assert not bm.can_allocate(seq([9] * 5, name="c"), 5)


def test_salts_isolate_tenants():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    admit_and_compute(bm, seq(prompt, salt="tenant-a"))
    assert bm.find_cached_prefix(seq(prompt, salt="tenant-b")) == []
    assert bm.find_cached_prefix(seq(prompt)) == []
    assert len(bm.find_cached_prefix(seq(prompt, salt="tenant-a"))) == 3


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admit_and_compute(bm, seq(list(range(13))))
    assert bm.find_cached_prefix(seq(list(range(13)))) == []


def test_duplicate_blocks_computed_concurrently_stay_consistent():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = seq([1, 2, 3], name="a"), seq([1, 2, 3], name="b")
    for s in (a, b):  # both admitted before either computed
        bm.allocate(s, 3)
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.register_full_blocks(s)
    assert bm.find_cached_prefix(seq([1, 2, 9])) == a.block_table[:1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache_forgets_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    admit_and_compute(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(seq([1, 2, 3])) == []
    assert bm.num_free_blocks == 8
