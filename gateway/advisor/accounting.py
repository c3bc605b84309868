"""Per-request accounting: how many prompt tokens would have been a prefix hit, per variant.

Each sampled request's fingerprints (the chain's own, ``observed``, and one per variant) are
compared with that family's last ``HISTORY`` fingerprints of the same variant; the stable prefix
is the longest over them (a provider's cache holds several recent prefixes, and two sessions of
one agent share a family). The stable prefix becomes cached tokens under the rules of the
route's cache family (``policies.provider_limits.cached_tokens``, the one table):

- OpenAI and Azure: exact prefix in 128-token steps from 1,024 tokens.
- DeepSeek: the stable prefix in 64-token units; Moonshot: the whole stable prefix.
- Gemini: the whole stable prefix once it reaches the model's implicit-caching minimum.
- Anthropic and Bedrock Converse: APPROXIMATED as the whole stable prefix once it reaches the
  model's minimum cacheable length. They read only at breakpoints (Anthropic within a 20-block
  lookback), so this is an upper bound: the hit really ends at the last breakpoint inside the
  stable prefix.

The history is stored as one blob per family (hashes only, no prompt text): the distinct
fingerprints once, and per variant the indexes of its last ones.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from policies.diagnostics import PrefixFingerprints, find_prefix_break
from policies.provider_limits import FAMILY_NAMES, cached_tokens

from .variants import OBSERVED, VARIANTS

HISTORY = 4  # previous fingerprints kept per family and variant
MAX_HISTORY_BYTES = 512 * 1024  # a family's history blob; older entries go first
BREAK_CLASSES = ("tools(order)", "tools", "params", "system", "messages")
_MAGIC = b"FTA1"


def field_names() -> tuple[str, ...]:
    """Every counter the advisor keeps per family and bucket."""
    per_variant = tuple(
        f"{what}:{variant}" for variant in (OBSERVED, *VARIANTS) for what in ("prompt", "cached")
    )
    breaks = tuple(f"break:{kind}" for kind in BREAK_CLASSES)
    return (
        "requests",
        "prompt",
        "sampled",
        *(f"route:{family}" for family in FAMILY_NAMES),
        *per_variant,
        *breaks,
    )


@dataclass(frozen=True)
class CacheRules:
    family: str  # a ``policies.provider_limits`` cache family
    model: str = ""  # the minimums of some families depend on the model

    def cached(self, stable_tokens: int) -> int:
        return cached_tokens(self.family, self.model, stable_tokens)


History = dict[str, list[PrefixFingerprints]]


def encode_history(history: History) -> bytes:
    """Distinct fingerprints once, then per variant its entries' indexes (oldest first)."""
    table: dict[bytes, int] = {}
    variants: list[tuple[str, list[int]]] = []
    for variant, entries in history.items():
        indexes = []
        for prints in entries:
            data = prints.to_bytes()
            indexes.append(table.setdefault(data, len(table)))
        variants.append((variant, indexes))
    out = [_MAGIC, struct.pack("<H", len(table))]
    for data in table:
        out += [struct.pack("<I", len(data)), data]
    out.append(struct.pack("<B", len(variants)))
    for variant, indexes in variants:
        name = variant.encode()
        out += [struct.pack("<BB", len(name), len(indexes)), name]
        out += [struct.pack("<H", index) for index in indexes]
    return b"".join(out)


def decode_history(blob: bytes | None) -> History:
    """``encode_history``'s input; an absent or unreadable blob reads as no history."""
    if not blob or blob[:4] != _MAGIC:
        return {}
    try:
        (count,) = struct.unpack_from("<H", blob, 4)
        offset = 6
        table = []
        for _ in range(count):
            (size,) = struct.unpack_from("<I", blob, offset)
            offset += 4
            table.append(PrefixFingerprints.from_bytes(blob[offset : offset + size]))
            offset += size
        (n_variants,) = struct.unpack_from("<B", blob, offset)
        offset += 1
        history: History = {}
        for _ in range(n_variants):
            name_len, n_entries = struct.unpack_from("<BB", blob, offset)
            offset += 2
            name = blob[offset : offset + name_len].decode()
            offset += name_len
            indexes = struct.unpack_from(f"<{n_entries}H", blob, offset)
            offset += 2 * n_entries
            history[name] = [table[index] for index in indexes]
        return history
    except (struct.error, ValueError, IndexError, UnicodeDecodeError):
        return {}


def _best_stable(
    previous: list[PrefixFingerprints],
    current: PrefixFingerprints,
    known: dict[tuple[int, int], int],
) -> int:
    """The longest stable prefix over the previous fingerprints (0 without history). Which
    breaks a request made is the diagnostics' verdict (``policies.prefix_breaks``), counted
    for every request where the header is set, not here. ``known`` holds the comparisons made
    for other variants of the same request, by the objects compared: a variant that changed
    nothing shares its fingerprints and its history's with the observed request."""
    best = 0
    for old in previous:
        key = (id(old), id(current))
        stable = known.get(key)
        if stable is None:
            found = find_prefix_break(old, current)
            stable = known[key] = old.total_tokens if found is None else found.stable_tokens
        best = max(best, stable)
    return best


def evaluate(
    history: History, current: dict[str, PrefixFingerprints], rules: CacheRules
) -> tuple[dict[str, int], bytes]:
    """This request's counter deltas (sampled only: ``requests`` and ``prompt`` are counted for
    every request elsewhere) and the family's new history, encoded."""
    fields: dict[str, int] = {"sampled": 1}
    known: dict[tuple[int, int], int] = {}  # the compared objects all live until we return
    for variant, prints in current.items():
        stable = min(_best_stable(history.get(variant, []), prints, known), prints.total_tokens)
        fields[f"prompt:{variant}"] = prints.total_tokens
        fields[f"cached:{variant}"] = rules.cached(stable)
    new: History = {}
    for variant, prints in current.items():
        new[variant] = [*history.get(variant, [])[-(HISTORY - 1) :], prints]
    return fields, _encode_bounded(new)


def _encode_bounded(history: History) -> bytes:
    """The history's blob, its oldest entries dropped until it fits ``MAX_HISTORY_BYTES``
    (maybe all)."""
    blob = encode_history(history)
    while history and len(blob) > MAX_HISTORY_BYTES:
        longest = max(len(entries) for entries in history.values())
        history = (
            {
                variant: entries[1:] if len(entries) == longest else entries
                for variant, entries in history.items()
            }
            if longest
            else {}
        )
        blob = encode_history(history)
    return blob
