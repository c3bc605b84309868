"""A conversation's key (its first turn's prompt) and where its turns went."""

from __future__ import annotations

import pytest

from gateway.upstreams.replicas.prefix_index import ConversationHomes, conversation_key, prompt_text

SYSTEM = {"role": "system", "content": "You are terse. " * 40}


def turns(first_user: str) -> list[str]:
    """The prompt texts of a conversation's first three turns."""
    messages: list[dict] = [SYSTEM, {"role": "user", "content": first_user}]
    out = [prompt_text({"messages": list(messages)})]
    for i in range(2):
        messages += [
            {"role": "assistant", "content": f"answer {i}"},
            {"role": "user", "content": f"and then {i}?"},
        ]
        out.append(prompt_text({"messages": list(messages)}))
    return out


def test_every_turn_of_a_conversation_has_its_first_turn_s_key() -> None:
    one, two = turns("What is a prefix cache?"), turns("What is a radix tree?")
    assert len({conversation_key(t) for t in one}) == 1
    assert conversation_key(one[0]) != conversation_key(two[0])
    # the same conversation under two tenants of an isolating route is two conversations
    assert conversation_key(one[1], "tenant-a") != conversation_key(one[1], "tenant-b")


def test_homes_remember_the_last_replica_and_forget_the_oldest() -> None:
    homes = ConversationHomes(max_entries=2)
    homes.placed(1, "a")
    homes.placed(2, "b")
    homes.placed(1, "c")  # its next turn went elsewhere; 1 is now the most recent
    homes.placed(3, "a")
    assert (homes.get(1), homes.get(2), homes.get(3)) == ("c", None, "a")
    assert len(homes) == 2
    with pytest.raises(ValueError):
        ConversationHomes(max_entries=0)
