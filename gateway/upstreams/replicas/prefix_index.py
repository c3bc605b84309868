"""What each replica probably holds in its prefix cache, as the gateway saw it.

An engine with prefix caching (vLLM, SGLang, the bundled engine) keeps the KV of recent prompts
and reuses it for any later prompt that starts the same way. The gateway cannot ask which
prefixes an engine still holds, but it knows what it sent where: `PrefixIndex` remembers the
prompts recently sent to one replica, bounded in memory, and `matched` tells how much of a new
prompt that replica has likely cached.

Prompts are cut into fixed blocks of characters and hashed as a chain (`prefix_blocks`): a
block's hash covers everything before it, so equal blocks after different prefixes never match
(an engine cannot reuse them either) and one dict lookup per block answers "is this prefix
there". Characters, not tokens: no tokenizer runs on the request path, and a block boundary
that differs from the engine's only loses part of one block.

Where each conversation's last turn went (`ConversationHomes`, keyed by `conversation_key`):
the index tells which replica holds most of a prompt, but it cannot always tell a
conversation from its tenant's others. A second turn whose first turn added no whole block
past the shared system prompt matches a replica holding only that system prompt as well as the
one that served the first turn. Every later turn of a conversation starts with its first turn's
whole prompt (the text up to the first assistant message), so a hash of that text names the
conversation, and the balancer remembers, for recent ones, the replica its last turn was sent
to. In one gateway process only (Python's string hash is keyed per process, which also keeps a
client from crafting two conversations that pass for one); other processes fall back on the
index, which shared placements keep in step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from hashlib import blake2b
from typing import Any

import orjson

BLOCK_CHARS = 256  # ~64 tokens: fine enough to follow a chat turn, coarse enough to hash fast
DIGEST_BYTES = 8
# What one entry costs in the index, counted against max_bytes: the 8-byte digest plus CPython's
# overhead for it (a bytes object of 8 bytes is 41 bytes; an OrderedDict slot and its link node
# add about 100 more; the send order it maps to, an int shared by one prompt's blocks, 28 at
# worst). 184 rounds an entry up to 192 bytes, so max_bytes is a real upper bound.
ENTRY_OVERHEAD = 184
ENTRY_BYTES = DIGEST_BYTES + ENTRY_OVERHEAD
_SENDS = itertools.count(1)  # one order for every index of the process: comparable across them
MAX_CONVERSATIONS = 32 * 1024  # ~120 bytes each: ~4 MB at most


def prefix_blocks(text: str, seed: str = "", block_chars: int = BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of `text` in blocks of `block_chars` characters, the last partial block
    dropped (an engine caches whole blocks only, and the tail is what differs next time).

    h_i = blake2b(h_{i-1} + block_i, 8 bytes), with h_{-1} = blake2b(seed): a route that isolates
    tenants passes the tenant as `seed`, so that equal prompts of two tenants never match.
    """
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    h = blake2b(seed.encode(), digest_size=DIGEST_BYTES).digest()
    out: list[bytes] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = blake2b(
            h + text[start : start + block_chars].encode(), digest_size=DIGEST_BYTES
        ).digest()
        out.append(h)
    return out


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of an OpenAI chat or completions body as one string, in the order an engine's
    template lays it out: tools first, then each message's role, text and tool calls.

    The policies have already canonicalized the body, so a plain serialization is stable. Image
    and audio parts count as their type only (hashing a base64 image on every request would
    cost more than it predicts); text-free requests simply match less.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        tools = body.get("tools")
        if tools:
            parts.append(orjson.dumps(tools).decode())
        for message in messages:
            if isinstance(message, dict):
                _message_text(message, parts)
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def role_mark(role: object) -> str:
    """How `prompt_text` marks the start of a message of `role`."""
    return f"\x1e{role}\x1f"


ASSISTANT = role_mark("assistant")


def _message_text(message: dict[str, Any], parts: list[str]) -> None:
    parts.append(role_mark(message.get("role", "")))
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            parts.append(text if isinstance(text, str) else f"\x1d{part.get('type', '')}\x1d")
    tool_calls = message.get("tool_calls")
    if tool_calls:
        parts.append(orjson.dumps(tool_calls).decode())


class PrefixIndex:
    """Block hashes recently sent to one replica, least recently used first out, bounded by bytes
    (each entry counts `ENTRY_BYTES`).

    `add` refreshes a prompt's blocks from the last to the first, so a prefix is always at least
    as recent as anything that extends it: eviction takes the tails of old prompts first (as
    vLLM does) and a present block always has its whole chain present. Each block remembers
    when it was last sent (`last_sent`, in an order shared by every index of the process), so
    that of two replicas holding the same prefix the one that was sent it last, where its
    conversation went on, can be told from the other.
    """

    def __init__(self, max_bytes: int = 4 * 1024 * 1024) -> None:
        if max_bytes < ENTRY_BYTES:
            raise ValueError(f"max_bytes must hold at least one entry ({ENTRY_BYTES} bytes)")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def matched(self, blocks: list[bytes]) -> int:
        """How many leading blocks are present (stops at the first miss). Does not refresh: a
        replica that is only considered has not been sent anything."""
        entries = self._entries
        n = 0
        for block in blocks:
            if block not in entries:
                break
            n += 1
        return n

    def last_sent(self, block: bytes) -> int:
        """When `block` was last sent here, in the process's order of sends (0: not held)."""
        return self._entries.get(block, 0)

    def add(self, blocks: list[bytes]) -> None:
        """Insert or refresh every block, then evict the least recently used past max_bytes."""
        entries = self._entries
        sent = next(_SENDS)
        for block in reversed(blocks):
            if block in entries:
                entries.move_to_end(block)
            entries[block] = sent
        limit = self.max_bytes // ENTRY_BYTES
        while len(entries) > limit:
            entries.popitem(last=False)

    def pressure(self) -> tuple[int, int]:
        """How crowded this replica's cache is for a prefix it does not hold, smaller is
        roomier: (-free entries, 0) while the index has room, then (0, when its least recently
        sent block was sent). A full index whose oldest block was sent long ago turns over
        slowly, so what it is sent stays longest and pushes out only cold prompts; one whose
        oldest block is recent is thrashing. Sized near the engine's KV capacity, as the
        balancer's docstring advises, the index's churn stands for the engine's."""
        entries = self._entries
        free = self.max_bytes // ENTRY_BYTES - len(entries)
        if free > 0:
            return (-free, 0)
        return (0, next(iter(entries.values())))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * ENTRY_BYTES


class BlockChains:
    """`prefix_blocks` for a stream of prompts, hashing only what is new: the next turn of a
    conversation starts with the previous turn's prompt, so its chain starts with that one's.

    Recent chains are kept under their first block (and seed); each is marked at its last block
    and at every power-of-two block count by Python's string hash of the text up to there. A new
    prompt reuses the longest marked prefix whose text hashes the same (the longest first, so a
    follow-up finds its previous turn at once, and a new conversation of a known tenant finds
    the system prompt's chain at a power of two), then hashes the rest. A string hash costs a
    memory pass over the text, ~50x less than the blake2b chain it saves; Python keys it with a
    random per-process secret, so no client can craft two texts that pass for each other.
    Bounded: `per_start` chains per first block, `max_blocks` blocks held in all (least
    recently used first out).
    """

    def __init__(
        self, max_blocks: int = 256 * 1024, per_start: int = 8, block_chars: int = BLOCK_CHARS
    ) -> None:
        self.max_blocks = max_blocks
        self.per_start = per_start
        self.block_chars = block_chars
        self._starts: OrderedDict[tuple[str, str], list[_Chain]] = OrderedDict()
        self._held = 0

    def blocks(self, text: str, seed: str = "") -> list[bytes]:
        """The same list as `prefix_blocks(text, seed, block_chars)`."""
        size = self.block_chars
        n = len(text) // size
        if n == 0:
            return []
        key = (seed, text[:size])
        chains = self._starts.get(key)
        reused: list[bytes] = []
        marks: dict[int, int] = {}
        if chains is not None:
            self._starts.move_to_end(key)
            reused, marks = _longest(text, n, size, chains)
        k = len(reused)
        h = reused[-1] if reused else blake2b(seed.encode(), digest_size=DIGEST_BYTES).digest()
        out = reused
        for start in range(k * size, n * size, size):
            h = blake2b(h + text[start : start + size].encode(), digest_size=DIGEST_BYTES).digest()
            out.append(h)
        self._keep(key, text, out, marks)
        return out

    def _keep(self, key: tuple[str, str], text: str, blocks: list[bytes], marks: dict) -> None:
        size, n = self.block_chars, len(blocks)
        points = {1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n}
        marks = {p: marks[p] if p in marks else hash(text[: p * size]) for p in points}
        chains = self._starts.setdefault(key, [])
        chains.append(_Chain(blocks, marks))
        self._held += n
        while len(chains) > self.per_start:
            self._held -= len(chains.pop(0).blocks)
        while self._held > self.max_blocks and len(self._starts) > 1:
            _, dropped = self._starts.popitem(last=False)
            self._held -= sum(len(c.blocks) for c in dropped)

    def __len__(self) -> int:
        return self._held


class _Chain:
    __slots__ = ("blocks", "marks")

    def __init__(self, blocks: list[bytes], marks: dict[int, int]) -> None:
        self.blocks = blocks
        self.marks = marks  # block count -> hash(text[: count * block_chars])


def _longest(
    text: str, n: int, size: int, chains: list[_Chain]
) -> tuple[list[bytes], dict[int, int]]:
    """The longest marked prefix of `text` some chain holds (its blocks, copied, and the marks
    up to it), newest chains first."""
    counts = sorted({p for c in chains for p in c.marks if p <= n}, reverse=True)
    for count in counts:
        h = hash(text[: count * size])
        for chain in reversed(chains):
            if chain.marks.get(count) == h:
                marks = {p: v for p, v in chain.marks.items() if p <= count}
                return chain.blocks[:count], marks
    return [], {}


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
