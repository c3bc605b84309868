"""Cache-break diagnostics: where did this request's prefix stop matching the last one?

A prompt's prefix is fingerprinted block by block, in the order providers hash it: each tool,
then the parameters that invalidate later levels (``tool_choice``, ``response_format``), then
each message. A block's fingerprint is a digest of its bytes plus hashes of its text in chunks,
so the first differing character range can be named (``messages[0]@char 768``) without storing
any prompt text. Chunks are 256 characters; a long text uses coarser chunks (pairs of hashes
hashed together, up to 16 per block), so any two fingerprints can still be compared at the
coarser of their two resolutions.

What is left out of the fingerprint because it is not part of the cached prefix: ``cache_control``
markers (they move every turn), the volatile-values note (it is placed after the stable prefix
on purpose), and the difference between a string content and a single text part.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from policies.lru import BoundedLRU
from policies.request import SYSTEM_ROLES, content_text, is_text_part, role_of
from policies.tokens import (
    count_json,
    count_message,
    count_prompt,
    count_tool,
    without_cache_marker,
)
from policies.volatile import is_volatile_note

CHUNK_CHARS = 256
MAX_CHUNKS = 16
PARAM_KEYS = ("tool_choice", "response_format")
KINDS = ("tools", "params", "system", "messages")
_MAGIC = b"FTP1"
_BLOCK_HEAD = struct.Struct("<BB8sIIBB")


class BlockFingerprint(NamedTuple):
    """One block of a prompt's prefix. A named tuple: a request makes one per tool and message,
    on every request, and a tuple is made several times faster than a frozen dataclass."""

    label: str  # "tools[3]", "tool_choice", "messages[2]"
    kind: str  # one of KINDS
    digest: bytes  # 8 bytes over the block's normalized JSON
    text_len: int
    tokens: int
    level: int  # chunk size is CHUNK_CHARS << level
    chunks: bytes  # 4 bytes per chunk


@dataclass(frozen=True)
class PrefixBreak:
    location: str  # e.g. "tools[3]", "messages[0]@char 812", "tools(order)", "tool_choice"
    kind: str  # "tools" | "system" | "messages" | "params"
    stable_tokens: int  # leading tokens that were stable before the break


def _hash4(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=4).digest()


def _coarsen(chunks: list[bytes]) -> list[bytes]:
    return [_hash4(b"".join(chunks[index : index + 2])) for index in range(0, len(chunks), 2)]


def _chunk_hashes(text: str) -> tuple[int, bytes]:
    chunks = [
        _hash4(text[start : start + CHUNK_CHARS].encode("utf-8", "surrogatepass"))
        for start in range(0, len(text), CHUNK_CHARS)
    ]
    level = 0
    while len(chunks) > MAX_CHUNKS:
        chunks = _coarsen(chunks)
        level += 1
    return level, b"".join(chunks)


# What a block's normalized bytes give: digest, text length, chunk level, chunk hashes and token
# count (a function of those bytes: cache markers are in neither). A conversation's earlier blocks
# come back on every turn, so only its new messages are hashed and counted.
_block_cache: BoundedLRU[tuple[bytes, int, int, bytes, int]] = BoundedLRU(50_000, 64_000_000)
# Decoded fingerprints by their bytes; about 2 MB of blobs (a fingerprint holds no text).
_decoded: BoundedLRU[PrefixFingerprints] = BoundedLRU(10_000, 2_000_000)


def _fingerprint(
    label: str,
    kind: str,
    normalized: Any,
    text_of: Callable[[Any], str],
    count_of: Callable[[Any], int],
) -> BlockFingerprint:
    """The block of `normalized` (a tool, a parameter, a message without its cache markers);
    its text and tokens are read from it only when it was not seen recently."""
    raw = orjson.dumps(normalized)
    cached = _block_cache.get(raw)
    if cached is None:
        digest = hashlib.blake2b(raw, digest_size=8).digest()
        text = text_of(normalized)
        level, chunks = _chunk_hashes(text)
        cached = (digest, len(text), level, chunks, count_of(normalized))
        _block_cache.put(raw, cached, len(raw))
    digest, text_len, level, chunks, tokens = cached
    return BlockFingerprint(label, kind, digest, text_len, tokens, level, chunks)


def _no_text(_: Any) -> str:
    return ""


def _message_text(message: Any) -> str:
    return content_text(message.get("content")) if isinstance(message, dict) else ""


def _normalized_message(message: Any) -> Any:
    message = without_cache_marker(message)
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        parts = [without_cache_marker(part) for part in content]
        if len(parts) == 1 and is_text_part(parts[0]) and len(parts[0]) == 2:
            message = {**message, "content": parts[0]["text"]}
        else:
            message = {**message, "content": parts}
    return message


class PrefixFingerprints:
    """Per-block fingerprints of a request's prefix, in prefix order. Holds no prompt text."""

    def __init__(self, blocks: tuple[BlockFingerprint, ...]) -> None:
        self.blocks = blocks
        # Made once, when first asked for (the blocks never change; a family's recorded
        # fingerprints are compared with every request of the family).
        self._bytes: bytes | None = None
        self._keys: tuple[tuple[str, bytes], ...] | None = None
        self._tokens_before: list[int] | None = None
        self._leading: dict[frozenset[str], int] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrefixFingerprints) and self.blocks == other.blocks

    def __repr__(self) -> str:
        return f"PrefixFingerprints({len(self.blocks)} blocks, {self.total_tokens} tokens)"

    @property
    def total_tokens(self) -> int:
        return self.tokens_before(len(self.blocks))

    @property
    def keys(self) -> tuple[tuple[str, bytes], ...]:
        """Each block's label and digest: two fingerprints repeat a block when these are equal."""
        if self._keys is None:
            self._keys = tuple((block.label, block.digest) for block in self.blocks)
        return self._keys

    def tokens_before(self, index: int) -> int:
        """Tokens of the blocks before `index`."""
        if self._tokens_before is None:
            self._tokens_before = [0, *itertools.accumulate(b.tokens for b in self.blocks)]
        return self._tokens_before[index]

    def leading(self, kinds: frozenset[str]) -> int:
        """How many blocks at the start are of `kinds`."""
        count = self._leading.get(kinds)
        if count is None:
            count = 0
            for block in self.blocks:
                if block.kind not in kinds:
                    break
                count += 1
            self._leading[kinds] = count
        return count

    @classmethod
    def from_body(cls, body: dict) -> PrefixFingerprints:
        blocks: list[BlockFingerprint] = []
        for index, tool in enumerate(body.get("tools") or ()):
            normalized = without_cache_marker(tool)
            blocks.append(
                _fingerprint(f"tools[{index}]", "tools", normalized, _no_text, count_tool)
            )
        for key in PARAM_KEYS:
            if body.get(key) is not None:
                value = {key: body[key]}
                blocks.append(_fingerprint(key, "params", value, _no_text, count_json))
        messages = body.get("messages")
        if isinstance(messages, list):
            for index, message in enumerate(messages):
                if is_volatile_note(message):
                    continue
                kind = "system" if role_of(message) in SYSTEM_ROLES else "messages"
                blocks.append(
                    _fingerprint(
                        f"messages[{index}]",
                        kind,
                        _normalized_message(message),
                        _message_text,
                        count_message,
                    )
                )
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
            blocks.append(_fingerprint("prompt", "messages", prompt, str, count_prompt))
        return cls(tuple(blocks))

    def to_bytes(self) -> bytes:
        if self._bytes is None:
            self._bytes = self._encode()
        return self._bytes

    def _encode(self) -> bytes:
        out = [_MAGIC, struct.pack("<H", len(self.blocks))]
        for block in self.blocks:
            label = block.label.encode()
            out.append(
                _BLOCK_HEAD.pack(
                    KINDS.index(block.kind),
                    len(label),
                    block.digest,
                    block.text_len,
                    block.tokens,
                    block.level,
                    len(block.chunks) // 4,
                )
            )
            out.append(label)
            out.append(block.chunks)
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixFingerprints:
        """Decode ``to_bytes`` output; raises ``ValueError`` on anything else. A family's
        history is read back on each of its requests, so decoded fingerprints are kept by
        their bytes (they are immutable)."""
        data = bytes(data)
        cached = _decoded.get(data)
        if cached is None:
            cached = cls._decode(data)
            cached._bytes = data
            _decoded.put(data, cached, len(data))
        return cached

    @classmethod
    def interned(cls, prints: PrefixFingerprints) -> PrefixFingerprints:
        """The one object that ``from_bytes`` gives for these fingerprints' bytes, this one if
        none yet: a history made in memory then reads as its decoding would (the encoding is
        exact), and equal fingerprints stay one object."""
        data = prints.to_bytes()
        cached = _decoded.get(data)
        if cached is None:
            _decoded.put(data, prints, len(data))
            return prints
        return cached

    @classmethod
    def _decode(cls, data: bytes) -> PrefixFingerprints:
        if data[:4] != _MAGIC:
            raise ValueError("not a firsttoken prefix fingerprint")
        try:
            (count,) = struct.unpack_from("<H", data, 4)
            offset = 6
            blocks = []
            for _ in range(count):
                kind, label_len, digest, text_len, tokens, level, n_chunks = (
                    _BLOCK_HEAD.unpack_from(data, offset)
                )
                offset += _BLOCK_HEAD.size
                label = data[offset : offset + label_len].decode()
                offset += label_len
                chunks = data[offset : offset + 4 * n_chunks]
                offset += 4 * n_chunks
                if len(chunks) != 4 * n_chunks:
                    raise ValueError("truncated fingerprint")
                blocks.append(
                    BlockFingerprint(label, KINDS[kind], digest, text_len, tokens, level, chunks)
                )
        except (struct.error, IndexError, UnicodeDecodeError) as error:
            raise ValueError(f"corrupt prefix fingerprint: {error}") from error
        if offset != len(data):
            raise ValueError("trailing bytes after prefix fingerprint")
        return cls(tuple(blocks))


def _split(chunks: bytes) -> list[bytes]:
    return [chunks[index : index + 4] for index in range(0, len(chunks), 4)]


def first_changed_char(previous: BlockFingerprint, current: BlockFingerprint) -> int | None:
    """Start of the first chunk whose text differs, or None if the texts are equal."""
    if (
        previous.text_len == current.text_len
        and previous.level == current.level
        and previous.chunks == current.chunks
    ):
        return None
    level = max(previous.level, current.level)
    old = _at_level(previous.chunks, level - previous.level)
    new = _at_level(current.chunks, level - current.level)
    length = min(len(old), len(new))
    if old[:length] == new[:length]:
        return length // 4 * (CHUNK_CHARS << level)
    # The first differing byte is the highest one set in the two prefixes' XOR (big-endian).
    differ = int.from_bytes(old[:length], "big") ^ int.from_bytes(new[:length], "big")
    first_byte = length - (differ.bit_length() + 7) // 8
    return first_byte // 4 * (CHUNK_CHARS << level)


def _at_level(chunks: bytes, coarser: int) -> bytes:
    if not coarser:
        return chunks
    hashes = _split(chunks)
    for _ in range(coarser):
        hashes = _coarsen(hashes)
    return b"".join(hashes)


def _family_rank(block: BlockFingerprint) -> int:
    return 0 if block.kind == "tools" else 1 if block.kind == "params" else 2


def find_prefix_break(
    previous: PrefixFingerprints, current: PrefixFingerprints
) -> PrefixBreak | None:
    """The first block of ``previous`` that ``current`` does not repeat; None if all repeat."""
    stable = 0
    for index, old in enumerate(previous.blocks):
        if index >= len(current.blocks):
            return PrefixBreak(old.label, old.kind, stable)
        new = current.blocks[index]
        if old.label != new.label:
            first = old if _family_rank(old) <= _family_rank(new) else new
            return PrefixBreak(first.label, first.kind, stable)
        if old.digest == new.digest:
            stable += new.tokens
            continue
        if old.kind == "tools" and _same_tool_set(previous, current):
            return PrefixBreak("tools(order)", "tools", stable)
        char = first_changed_char(old, new)
        if char is None or old.kind in ("tools", "params"):
            return PrefixBreak(new.label, new.kind, stable)
        partial = new.tokens * min(char, new.text_len) // max(new.text_len, 1)
        return PrefixBreak(f"{new.label}@char {char}", new.kind, stable + partial)
    return None


def _same_tool_set(previous: PrefixFingerprints, current: PrefixFingerprints) -> bool:
    old = Counter(block.digest for block in previous.blocks if block.kind == "tools")
    new = Counter(block.digest for block in current.blocks if block.kind == "tools")
    return old == new


def stable_prefix_tokens(previous: PrefixFingerprints, current: PrefixFingerprints) -> int:
    """Leading tokens of ``current`` that repeat ``previous`` (all of it when nothing broke)."""
    found = find_prefix_break(previous, current)
    return previous.total_tokens if found is None else found.stable_tokens
