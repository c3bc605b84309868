"""Where each conversation's last turn went, so that its next turn finds its home.

The prefix index tells which replica holds most of a prompt, but it cannot always tell a
conversation from its tenant's others: a second turn whose first turn added no whole block
past the shared system prompt matches a replica holding only that system prompt as well as the
one that served the first turn. Every later turn of a conversation starts with its first turn's
whole prompt (the text up to the first assistant message), so a hash of that text names the
conversation; the balancer remembers, for recent ones, the replica its last turn was sent to.

In one gateway process only (Python's string hash is keyed per process, which also keeps a
client from crafting two conversations that pass for one); other processes fall back on the
prefix index, which shared placements keep in step.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.upstreams.replicas.prefix_index import role_mark

ASSISTANT = role_mark("assistant")
MAX_CONVERSATIONS = 32 * 1024  # ~120 bytes each: ~4 MB at most


def conversation_key(text: str, seed: str = "") -> int:
    """The conversation `text` (a `prompt_text`) belongs to: a hash of its first turn's prompt,
    with `seed` (the tenant, on a route that isolates tenants)."""
    cut = text.find(ASSISTANT)
    return hash((seed, text if cut < 0 else text[:cut]))


class ConversationHomes:
    """Recent conversations and the replica each last went to, least recently used first out."""

    def __init__(self, max_entries: int = MAX_CONVERSATIONS) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._homes: OrderedDict[int, str] = OrderedDict()

    def get(self, key: int) -> str | None:
        return self._homes.get(key)

    def placed(self, key: int, replica: str) -> None:
        homes = self._homes
        homes[key] = replica
        homes.move_to_end(key)
        if len(homes) > self.max_entries:
            homes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._homes)
