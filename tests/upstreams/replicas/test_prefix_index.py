"""The prefix index: chained block hashes, leading-match counting, LRU by bytes, prompt text."""

from __future__ import annotations

import pytest

from gateway.upstreams.replicas.prefix_index import (
    BLOCK_CHARS,
    ENTRY_BYTES,
    PrefixIndex,
    prefix_blocks,
    prompt_text,
)


def text(*blocks: str, size: int = BLOCK_CHARS) -> str:
    """One block of `size` characters per letter given."""
    return "".join((letter * size)[:size] for letter in blocks)


def test_blocks_are_whole_blocks_only() -> None:
    assert len(prefix_blocks(text("a", "b") + "c" * (BLOCK_CHARS - 1))) == 2
    assert prefix_blocks("x" * (BLOCK_CHARS - 1)) == []
    assert len(prefix_blocks("x" * 100, block_chars=10)) == 10


def test_blocks_are_deterministic_and_share_a_common_prefix() -> None:
    one, two = prefix_blocks(text("a", "b", "c")), prefix_blocks(text("a", "b", "d"))
    assert one == prefix_blocks(text("a", "b", "c"))
    assert one[:2] == two[:2] and one[2] != two[2]
    assert all(len(h) == 8 for h in one)


def test_same_block_after_a_different_prefix_does_not_match() -> None:
    one, two = prefix_blocks(text("a", "x")), prefix_blocks(text("b", "x"))
    assert one[1] != two[1]
    index = PrefixIndex()
    index.add(one)
    assert index.matched(two) == 0


def test_seed_keeps_equal_prompts_apart() -> None:
    a = prefix_blocks(text("a", "b"), seed="tenant-a")
    b = prefix_blocks(text("a", "b"), seed="tenant-b")
    assert not set(a) & set(b)
    index = PrefixIndex()
    index.add(a)
    assert index.matched(b) == 0 and index.matched(a) == 2


def test_matched_counts_leading_blocks_and_stops_at_first_miss() -> None:
    index = PrefixIndex()
    index.add(prefix_blocks(text("a", "b", "c", "d")))
    assert index.matched(prefix_blocks(text("a", "b", "c", "d", "e"))) == 4
    assert index.matched(prefix_blocks(text("a", "b", "z", "d"))) == 2
    assert index.matched([]) == 0
    raw = PrefixIndex()
    raw.add([b"first", b"third"])
    assert raw.matched([b"first", b"second", b"third"]) == 1


def test_eviction_by_bytes_keeps_the_recent_and_takes_old_tails_first() -> None:
    index = PrefixIndex(max_bytes=10 * ENTRY_BYTES)
    old, mid, new = (prefix_blocks(text(p + "1", p + "2", p + "3", p + "4")) for p in "xyz")
    for blocks in (old, mid, new):
        index.add(blocks)
    assert len(index) == 10 and index.nbytes == 10 * ENTRY_BYTES
    assert index.matched(new) == 4 and index.matched(mid) == 4
    assert index.matched(old) == 2  # its last two blocks went first, its start stayed


def test_adding_again_refreshes() -> None:
    index = PrefixIndex(max_bytes=8 * ENTRY_BYTES)
    old, mid, new = (prefix_blocks(text(p + "1", p + "2", p + "3", p + "4")) for p in "xyz")
    index.add(old)
    index.add(mid)
    index.add(old)  # old is now more recent than mid
    index.add(new)
    assert index.matched(old) == 4 and index.matched(new) == 4 and index.matched(mid) == 0


def test_index_needs_room_for_one_entry() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_bytes=ENTRY_BYTES - 1)


def chat(*turns: dict) -> dict:
    return {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
        "messages": [{"role": "system", "content": "You are terse."}, *turns],
    }


def test_prompt_text_covers_tools_roles_parts_and_tool_calls() -> None:
    body = chat(
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "lookup", "arguments": "{}"}}],
        },
    )
    out = prompt_text(body)
    assert out.startswith('[{"type":"function"')
    for piece in ("You are terse.", "hello", "image_url", '"name":"lookup","arguments":"{}"'):
        assert piece in out
    assert out.index("system") < out.index("hello") < out.index('"id":"c1"')
    other_role = chat({"role": "assistant", "content": [{"type": "text", "text": "hello"}]})
    assert prompt_text(other_role) != prompt_text(chat({"role": "user", "content": "hello"}))


def test_a_later_turn_extends_the_earlier_prompt() -> None:
    first = chat({"role": "user", "content": "q1"})
    later = chat(
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    )
    assert prompt_text(later).startswith(prompt_text(first))


def test_prompt_text_of_completions() -> None:
    assert prompt_text({"model": "m", "prompt": "once upon"}) == "once upon"
    assert prompt_text({"model": "m", "prompt": [1, 2, 3]}) == ""
    assert prompt_text({"model": "m"}) == ""


def test_last_sent_tells_which_of_two_indexes_was_sent_a_prefix_last() -> None:
    blocks = prefix_blocks(text("a", "b", "c"))
    early, late = PrefixIndex(), PrefixIndex()
    early.add(blocks)
    late.add(blocks)
    assert late.last_sent(blocks[-1]) > early.last_sent(blocks[-1]) > 0
    early.add(blocks[:2])  # a prompt sharing only the first two blocks refreshes those alone
    assert early.last_sent(blocks[1]) > late.last_sent(blocks[1])
    assert early.last_sent(blocks[2]) < late.last_sent(blocks[2])
    assert early.last_sent(b"never sent") == 0
