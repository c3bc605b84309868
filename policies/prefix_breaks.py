"""Prefix breaks of a family: where a request broke the prefix its family's requests share.

``diagnostics`` says where two fingerprints first differ; this module says whether that is a
*break*. A break is a divergence inside the part of the prompt that the family's requests have
shared so far:

- the **anchor**: the tools, the parameters that invalidate later levels (``tool_choice``,
  ``response_format``) and the leading system messages. They define the family (its key is made
  of them), so they are shared from the family's first request on: a changed clock in the
  system prompt, or tools sent in a new order, is a break;
- the **earlier turns of a conversation**: the leading blocks a recorded request repeated from
  an earlier one of its family (its ``shared`` count). A new question, or an answer that grows
  the conversation by appending, is new text, never a break; neither is a new conversation (its
  first message differs from the recorded one's and nothing after it repeats it).

The family keeps its last ``HISTORY`` requests (a provider's cache holds several recent prefixes,
and the sessions of one agent share a family). A request is compared with each and judged by
the one it repeats longest; of two it repeats equally far, the one whose conversation it
continues (only that one can see a changed earlier turn), else the newest.

When several blocks changed, every one is named, in the order OpenAI and Anthropic hash a
prompt: tools, then ``tool_choice``/``response_format``, then the system messages, then the
first changed earlier turn (everything after it differs anyway). A chat template (vLLM, SGLang)
may render the system text before the tools; the order then differs from the rendering, but
every changed block is still named, so fixing all the named ones restores the prefix. The
stable-token count is taken in the same provider order.

The header (``x-firsttoken-prefix-break``), Prometheus' ``firsttoken_prefix_breaks_total``, the
advisor's counters and the dashboard all count the breaks this module finds, once per request.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass

from policies.diagnostics import (
    BlockFingerprint,
    PrefixFingerprints,
    first_changed_char,
)
from policies.lru import BoundedLRU

HISTORY = 8  # recent requests kept per family
MAX_HISTORY_BYTES = 256 * 1024  # a family's blob; the oldest requests go first
MAX_NAMED = 8  # changed blocks named in one header; the count says how many more
ANCHOR_KINDS = frozenset({"tools", "params", "system"})
_MAGIC = b"FTH1"
_ENTRY_HEAD = struct.Struct("<HI")
# A family's blob comes back on each of its requests, most often the very blob its previous
# request stored: decoded histories are kept by their bytes (they are immutable).
_decoded_histories: BoundedLRU[tuple[RecordedRequest, ...]] = BoundedLRU(10_000, 16_000_000)


@dataclass(frozen=True)
class RecordedRequest:
    """A request of the family: its fingerprints and how many leading blocks were shared."""

    prints: PrefixFingerprints
    shared: int


@dataclass(frozen=True)
class BlockBreak:
    location: str  # "tools(order)", "tools[2]", "tool_choice", "messages[0]@char 1024"
    kind: str  # "tools" | "params" | "system" | "messages"

    @property
    def kind_class(self) -> str:
        """The advisor's and dashboard's class: the tools' order apart from a changed tool."""
        return "tools(order)" if self.location == "tools(order)" else self.kind


@dataclass(frozen=True)
class FamilyBreak:
    """What one request did to its family's shared prefix."""

    breaks: tuple[BlockBreak, ...]  # empty: nothing shared was broken
    stable_tokens: int  # leading tokens repeated from the best-matching earlier request

    @property
    def header(self) -> str:
        named = [block.location for block in self.breaks[:MAX_NAMED]]
        if len(self.breaks) > MAX_NAMED:
            named.append(f"+{len(self.breaks) - MAX_NAMED} more")
        return ", ".join(named)


def anchor_length(prints: PrefixFingerprints) -> int:
    """Leading blocks that define the family: tools, parameters, leading system messages."""
    return prints.leading(ANCHOR_KINDS)


def _common(previous: PrefixFingerprints, current: PrefixFingerprints) -> tuple[int, int]:
    """Leading blocks both repeat, and their tokens plus the repeated part of the next block."""
    old_keys, new_keys = previous.keys, current.keys
    length = min(len(old_keys), len(new_keys))
    if old_keys[:length] == new_keys[:length]:  # the usual case: one extends the other
        return length, current.tokens_before(length)
    index = next(i for i in range(length) if old_keys[i] != new_keys[i])
    stable = current.tokens_before(index)
    old, new = previous.blocks[index], current.blocks[index]
    if old.label == new.label and new.kind not in ("tools", "params"):
        char = first_changed_char(old, new)
        if char:
            stable += new.tokens * min(char, new.text_len) // max(new.text_len, 1)
    return index, stable


def _section(prints: PrefixFingerprints, kind: str, stop: int) -> list[BlockFingerprint]:
    return [block for block in prints.blocks[:stop] if block.kind == kind]


def _located(old: BlockFingerprint | None, new: BlockFingerprint | None) -> BlockBreak:
    block = new if new is not None else old
    assert block is not None
    if old is not None and new is not None and block.kind in ("system", "messages"):
        char = first_changed_char(old, new)
        if char is not None:
            return BlockBreak(f"{block.label}@char {char}", block.kind)
    return BlockBreak(block.label, block.kind)


def _pairwise(old: list[BlockFingerprint], new: list[BlockFingerprint]) -> list[BlockBreak]:
    found = []
    for index in range(max(len(old), len(new))):
        a = old[index] if index < len(old) else None
        b = new[index] if index < len(new) else None
        if a is None or b is None or a.label != b.label or a.digest != b.digest:
            found.append(_located(a, b))
    return found


def _anchor_breaks(previous: PrefixFingerprints, current: PrefixFingerprints) -> list[BlockBreak]:
    old_end, new_end = anchor_length(previous), anchor_length(current)
    found: list[BlockBreak] = []
    old_tools = _section(previous, "tools", old_end)
    new_tools = _section(current, "tools", new_end)
    if [b.digest for b in old_tools] != [b.digest for b in new_tools]:
        same_set = Counter(b.digest for b in old_tools) == Counter(b.digest for b in new_tools)
        found += (
            [BlockBreak("tools(order)", "tools")] if same_set else _pairwise(old_tools, new_tools)
        )
    old_params = {b.label: b for b in _section(previous, "params", old_end)}
    new_params = {b.label: b for b in _section(current, "params", new_end)}
    for label in sorted(old_params.keys() | new_params.keys()):
        a, b = old_params.get(label), new_params.get(label)
        if a is None or b is None or a.digest != b.digest:
            found.append(_located(a, b))
    found += _pairwise(_section(previous, "system", old_end), _section(current, "system", new_end))
    return found


def _conversation_break(entry: RecordedRequest, current: PrefixFingerprints) -> BlockBreak | None:
    """The first changed earlier turn, when it lies inside the recorded request's shared part
    and the request continues the same conversation."""
    previous = entry.prints
    old_start, new_start = anchor_length(previous), anchor_length(current)
    old_turns, new_turns = previous.blocks[old_start:], current.blocks[new_start:]
    shared_turns = min(entry.shared, len(previous.blocks)) - old_start
    for index in range(min(shared_turns, len(old_turns))):
        if index >= len(new_turns):
            return None  # the request ends inside the shared turns: a prefix, nothing changed
        new = new_turns[index]
        if new.digest == old_turns[index].digest:
            continue
        if index == 0:
            # The conversation's first message differs: the same conversation only if what
            # follows it repeats (an edited first turn), else a new one after the same anchor.
            if len(old_turns) < 2 or len(new_turns) < 2:
                return None
            if old_turns[1].digest != new_turns[1].digest:
                return None
        return _located(old_turns[index], new)
    return None


def _verdict(
    entry: RecordedRequest, current: PrefixFingerprints, diverged: int, stable: int
) -> FamilyBreak:
    """What ``current`` broke of one recorded request's shared prefix, given how far it repeats
    it (``_common``)."""
    if diverged >= len(entry.prints.blocks):
        return FamilyBreak((), entry.prints.total_tokens)
    found = []
    if diverged < max(anchor_length(entry.prints), anchor_length(current)):
        found = _anchor_breaks(entry.prints, current)
    turn = _conversation_break(entry, current)
    if turn is not None:
        found.append(turn)
    return FamilyBreak(tuple(found), stable)


def family_break(
    history: list[RecordedRequest], current: PrefixFingerprints
) -> tuple[FamilyBreak | None, RecordedRequest]:
    """The break judged against the best-matching recorded request (None without history), and
    ``current`` as the family will record it.

    Every recorded request is measured (how far ``current`` repeats it: cheap), and only those
    repeated longest are judged for breaks: of them the newest with a break, else the newest."""
    measured: list[tuple[RecordedRequest, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for entry in reversed(history):  # newest first: it wins the remaining ties
        distinct = (id(entry.prints), entry.shared)  # decoding shares equal fingerprints
        if distinct in seen:
            continue
        seen.add(distinct)
        diverged, stable = _common(entry.prints, current)
        if diverged >= len(entry.prints.blocks):
            stable = entry.prints.total_tokens
        measured.append((entry, diverged, stable))
    best: FamilyBreak | None = None
    shared = anchor_length(current)
    if measured:
        longest = max(stable for _, _, stable in measured)
        for entry, diverged, stable in measured:
            if stable != longest:
                continue
            verdict = _verdict(entry, current, diverged, stable)
            if best is None or (verdict.breaks and not best.breaks):
                best, matched_diverged = verdict, diverged
                if verdict.breaks:
                    break
        shared = max(shared, matched_diverged)
    return best, RecordedRequest(current, shared)


def encode_history(history: list[RecordedRequest]) -> bytes:
    """The family's last ``HISTORY`` requests (oldest first), within ``MAX_HISTORY_BYTES``.

    The family's next request reads this blob back, so its decoding is kept now (by the blob's
    bytes, as ``decode_history`` keeps what it decodes): the encoding is exact, so the entries
    as they are in memory are what decoding would give."""
    kept = history[-HISTORY:]
    entries = [(entry.shared, entry.prints.to_bytes()) for entry in kept]
    while entries and sum(len(data) + _ENTRY_HEAD.size for _, data in entries) > MAX_HISTORY_BYTES:
        entries.pop(0)
        kept = kept[1:]
    out = [_MAGIC, struct.pack("<B", len(entries))]
    for shared, data in entries:
        out += [_ENTRY_HEAD.pack(min(shared, 0xFFFF), len(data)), data]
    blob = b"".join(out)
    if _decoded_histories.get(blob) is None:  # a family whose requests repeat: already kept
        decoded = tuple(
            RecordedRequest(PrefixFingerprints.interned(entry.prints), min(entry.shared, 0xFFFF))
            for entry in kept
        )
        _decoded_histories.put(blob, decoded, len(blob))
    return blob


def decode_history(blob: bytes | bytearray | memoryview | None) -> list[RecordedRequest]:
    """``encode_history``'s input; a single fingerprint (an older gateway's blob) reads as one
    request sharing its anchor, and anything unreadable as no history."""
    if not blob:
        return []
    blob = bytes(blob)  # a store may hand back a memoryview or bytearray
    known = _decoded_histories.get(blob)
    if known is not None:
        return list(known)
    history = _decode_history(blob)
    _decoded_histories.put(blob, tuple(history), len(blob))
    return history


def _decode_history(blob: bytes) -> list[RecordedRequest]:
    try:
        if blob[:4] != _MAGIC:
            prints = PrefixFingerprints.from_bytes(blob)
            return [RecordedRequest(prints, anchor_length(prints))]
        (count,) = struct.unpack_from("<B", blob, 4)
        offset = 5
        history = []
        for _ in range(count):
            shared, size = _ENTRY_HEAD.unpack_from(blob, offset)
            offset += _ENTRY_HEAD.size
            prints = PrefixFingerprints.from_bytes(blob[offset : offset + size])
            offset += size
            history.append(RecordedRequest(prints, shared))
        return history
    except (struct.error, ValueError):
        return []
