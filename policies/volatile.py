"""Volatile values in the system prompt: find them, replace them, state them at the end.

A clock, a request id or a git hash near the top of a prompt changes the prompt's bytes on
every request, so no provider cache ever reaches past it. The opt-in
``FIRSTTOKEN_CANONICALIZE_VOLATILE`` replaces each such value in system messages with a stable
placeholder (``[time_1]``, ``[date_1]``, ``[id_1]``) and appends one short note after the last
message stating the current values, so everything before the note stays byte-identical.

Where the note goes, and as which role:
- ``openai`` routes: a ``system`` message; OpenAI accepts system messages anywhere.
- ``anthropic`` and ``local`` routes: a ``user`` message. Anthropic has no mid-conversation
  system role (a translator would hoist it into the top-level system prompt, the very prefix we
  are protecting); consecutive user turns are merged into one, so alternation is kept. Strict
  local chat templates likewise reject a late system message.
- If the last message is an assistant prefill, the note goes just before it, so the prefill
  stays last.
The note starts with ``NOTE_MARKER``, which makes the transform idempotent and lets the
fingerprints leave the note out of the stable prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from policies import textscan
from policies.lru import BoundedLRU

NOTE_MARKER = "[firsttoken: current values]"

# One word boundary, then only where a value can start (a digit, a hex digit, a month's initial):
# the same matches as trying each kind behind its own \b, three times faster on prose.
_VOLATILE_SOURCE = (
    r"\b(?=[\dA-Fa-fJMASOND])(?:"
    r"(?P<time>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?(?!\d))"
    r"|(?P<id>[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)"
    r"|(?P<date>\d{4}-\d{2}-\d{2}\b"
    r"|(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2}, \d{4}\b)"
    r"|(?P<clock>\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b)"
    r"|(?P<hex>[0-9a-fA-F]{12,}\b)"
    r")"
)
_VOLATILE = re.compile(_VOLATILE_SOURCE)
# The same pattern for a text that is all ASCII, where \b, \d and \w mean what they mean in
# Unicode, so the matches are the same; the engine then tests characters against its ASCII
# tables instead of Unicode's, 2-3x faster. A new system prompt is scanned before its request
# goes upstream (its family key masks these values), so this is time to the first token.
_VOLATILE_ASCII = re.compile(_VOLATILE_SOURCE, re.ASCII)
# A long text is searched in pieces, each cut right after a character that no value can
# contain, whatever surrounds it (the values' own shapes say so), searched with the real text
# before it in view: a character outside the values' alphabet; a space that a value neither
# continues through (a value's space is followed by "dd:", "d,", "dd," or "ddd") nor reaches
# (it follows "-dd", a word, "." or ","); ",", ":", ".", "+", "-" or "T" where the digits
# around it cannot make a value of it. None of these can end a value, so a piece's last
# character is not read as the end of one where the whole text would continue it.
_CUT = re.compile(
    r"[^\dA-Za-z \-:.+,]"
    r"| (?=\D|\d[^\d,]|\d\d[^\d:,])|(?<!-\d\d)(?<![a-z.,]) "
    r"|,(?=[^ ]| \D)|(?<!\d),"
    r"|:(?=\D|\d\D)"
    r"|\.(?=[^\d ])|(?<!\d\d)(?<![a-z])\."
    r"|\+(?=\D)|(?<![.\d]\d)\+"
    r"|-(?=[^\dA-Fa-f])|(?<!\d\d)(?<!\.\d)(?<![0-9a-fA-F]{4})-"
    r"|T(?=\D|\d\D)|(?<!\d\d)T"
)
_HAS_DIGIT = re.compile(r"\d")
_PLACEHOLDER_KIND = {"time": "time", "clock": "time", "date": "date", "id": "id", "hex": "id"}


Match = tuple[int, int, str, str]  # start, end, placeholder kind, value
_finds: BoundedLRU[tuple[Match, ...]] = BoundedLRU(max_entries=20_000, max_weight=32_000_000)


def _is_volatile(match: re.Match[str]) -> bool:
    # A long hex run counts only when it mixes digits and letters: "1234567890123" is a number,
    # "deadbeefcafe" a word, "9fceb02d0ae5" an id.
    if match.lastgroup != "hex":
        return True
    value = match.group(0)
    return not value.isdigit() and _HAS_DIGIT.search(value) is not None


def find_volatile(text: str) -> tuple[Match, ...]:
    """Volatile values in ``text``, cached by text (a system prompt is resent on every turn)."""
    cached = _finds.get(text)
    if cached is not None:
        return cached
    found: tuple[Match, ...] = ()
    if textscan.search(_HAS_DIGIT, text) is not None:  # every volatile value has a digit
        found = tuple(
            (m.start(), m.end(), _PLACEHOLDER_KIND[m.lastgroup or "hex"], m.group(0))
            for m in _matches(text)
            if _is_volatile(m)
        )
    _finds.put(text, found, len(text))
    return found


def _matches(text: str) -> Iterator[re.Match[str]]:
    pattern = _VOLATILE_ASCII if text.isascii() else _VOLATILE
    if not textscan.is_long(text):
        yield from pattern.finditer(text)
        return
    for start, end in textscan.spans(text, _CUT):
        yield from pattern.finditer(text, start, end)


def has_volatile(text: str) -> bool:
    return bool(find_volatile(text))


def _substitute(text: str, found: tuple[Match, ...], name_of) -> str:
    pieces = []
    cursor = 0
    for start, end, kind, value in found:
        pieces.append(text[cursor:start])
        pieces.append(name_of(kind, value))
        cursor = end
    pieces.append(text[cursor:])
    return "".join(pieces)


class PlaceholderTable:
    """Assigns placeholders in order of first appearance; the same value keeps its placeholder."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}  # value -> placeholder
        self._counts: dict[str, int] = {}

    def placeholder(self, kind: str, value: str) -> str:
        existing = self.values.get(value)
        if existing is not None:
            return existing
        self._counts[kind] = self._counts.get(kind, 0) + 1
        name = f"[{kind}_{self._counts[kind]}]"
        self.values[value] = name
        return name

    def replace(self, text: str) -> str:
        found = find_volatile(text)
        return _substitute(text, found, self.placeholder) if found else text

    def note_text(self) -> str:
        pairs = "; ".join(f"{name} = {value}" for value, name in self.values.items())
        return f"{NOTE_MARKER} The placeholders in the instructions above stand for: {pairs}."


def mask_volatile(text: str) -> str:
    """Replace every volatile value with its kind only (for hashing a prompt's shape)."""
    found = find_volatile(text)
    return _substitute(text, found, lambda kind, value: f"[{kind}]") if found else text


def is_volatile_note(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")
    return isinstance(content, str) and content.startswith(NOTE_MARKER)


def note_message(table: PlaceholderTable, role: str) -> dict:
    """The note as a ``role`` message: "system" where the provider takes a late system
    message (``FamilyRules.late_system``), else "user"."""
    return {"role": role, "content": table.note_text()}


def insert_note(messages: list[Any], note: dict) -> list[Any]:
    """Append the note after the last message (before a trailing assistant prefill)."""
    if (
        messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
        and not messages[-1].get("tool_calls")
        and note["role"] == "user"
    ):
        return [*messages[:-1], note, messages[-1]]
    return [*messages, note]
