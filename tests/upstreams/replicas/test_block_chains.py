"""Incremental block hashes: the same chains as hashing each prompt whole, turn after turn."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstreams.replicas import prefix_index
from gateway.upstreams.replicas.prefix_index import BlockChains, prefix_blocks


def conversation(rng: random.Random, system: str, turns: int) -> list[str]:
    text, out = system, []
    for i in range(turns):
        text += f"\x1euser\x1f{i} " + "".join(rng.choices("abcdefgh ", k=rng.randint(0, 700)))
        out.append(text)
        text += "\x1eassistant\x1f" + "x" * rng.randint(0, 300)
    return out


def test_conversations_and_tenants_get_the_same_chains_as_whole_hashing() -> None:
    rng = random.Random(3)
    chains = BlockChains(per_start=4)
    systems = ["S" * 3000, "S" * 2900 + "T" * 100, "short"]
    for _ in range(30):
        system = rng.choice(systems)
        seed = rng.choice(["", "tenant-a", "tenant-b"])
        for prompt in conversation(rng, system, rng.randint(1, 6)):
            assert chains.blocks(prompt, seed) == prefix_blocks(prompt, seed)


def test_a_follow_up_reuses_the_previous_turn_and_new_sessions_the_system_prompt(
    monkeypatch,
) -> None:
    calls = []
    real = prefix_index.blake2b
    monkeypatch.setattr(prefix_index, "blake2b", lambda *a, **k: calls.append(1) or real(*a, **k))
    chains = BlockChains()
    system = "You are a careful agent. " * 400  # 10,000 characters: 39 whole blocks
    first = system + "\x1euser\x1fhello"
    chains.blocks(first)
    (held,) = chains._starts.values()
    assert held[0].marks.keys() == {1, 2, 4, 8, 16, 32, 39}
    follow = first + "\x1eassistant\x1fhi\x1euser\x1f" + "more " * 100  # 41 blocks
    calls.clear()
    assert chains.blocks(follow) == prefix_blocks(follow)
    assert len(calls) == 2 + 1 + 41  # its 2 new blocks, then the whole check
    # another conversation with the same system prompt: the first turn's 39-block mark lies
    # inside the system prompt (10,000 characters), so only its own 2 blocks are new
    other = system + "\x1euser\x1fanother conversation " * 20  # 41 blocks
    calls.clear()
    assert chains.blocks(other) == prefix_blocks(other)
    assert len(calls) == 2 + 1 + 41
    third = "You are a careful agent. " * 200 + "different from block 20 on " * 300
    calls.clear()
    assert chains.blocks(third) == prefix_blocks(third)
    n = len(third) // 256
    assert len(calls) == (n - 16) + (n + 1)  # from the 16-block mark: 5,000 shared characters


def test_memory_is_bounded() -> None:
    chains = BlockChains(max_blocks=100, per_start=2)
    for i in range(50):
        chains.blocks(f"{i:04d}" + "z" * 5000)  # 19 blocks each, a new start each time
    assert len(chains) <= 100 + 19
    for i in range(5):
        chains.blocks("same start" + "y" * (2000 + i * 300))
    assert len(chains._starts[("", ("same start" + "y" * 300)[:256])]) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab\u00e9", min_size=0, max_size=900), min_size=1, max_size=6))
def test_any_sequence_of_prompts_matches_whole_hashing(parts: list[str]) -> None:
    chains = BlockChains(max_blocks=40, per_start=2, block_chars=16)
    text = ""
    for part in parts:
        text += part
        assert chains.blocks(text, "s") == prefix_blocks(text, "s", 16)
        assert chains.blocks(part, "s") == prefix_blocks(part, "s", 16)
