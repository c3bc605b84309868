"""Bounded scans over huge texts: no single regex or string call covers more than a piece.

The gateway runs policies on big bodies off the event loop, but one C call (a regex over a 4 MB
string) holds the GIL for its whole duration, and the loop thread waits that long. So texts
longer than ``WHOLE_MAX`` are scanned in windows of ``PIECE_CHARS`` and rewritten in pieces,
cut only where the caller's rules say that a cut cannot change the result (each caller proves
that for its own rules, and a property test checks it with tiny pieces). Texts up to
``WHOLE_MAX`` take the plain whole-text path, so normal requests pay nothing for this.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# Module constants (read at call time, so a test can make them tiny).
PIECE_CHARS = 8_192  # a regex over 2 pieces holds the GIL ~1 ms on prose, a few on the worst text
WHOLE_MAX = 32_768  # texts up to this length are scanned whole


def is_long(text: str) -> bool:
    return len(text) > WHOLE_MAX


def piece_size() -> int:
    return max(PIECE_CHARS, 4)


def contains(text: str, needle: str) -> bool:
    """``needle in text``, one window at a time for a long text."""
    if not is_long(text):
        return needle in text
    size = piece_size()
    overlap = len(needle) - 1
    return any(
        text.find(needle, start, start + size + overlap) >= 0 for start in range(0, len(text), size)
    )


def count(text: str, sub: str, start: int, end: int) -> int:
    """``text.count(sub, start, end)`` for a one-character ``sub``, window by window."""
    size = piece_size()
    return sum(text.count(sub, low, min(low + size, end)) for low in range(start, end, size))


def search(pattern: re.Pattern[str], text: str, start: int = 0) -> re.Match[str] | None:
    """The leftmost match of ``pattern`` at or after ``start``, searched window by window.

    ``pattern`` must match exactly one character; a lookahead in it must be positive (it then
    fails at a window's end rather than pass wrongly), and windows overlap by one character so
    that the last character of a window is tried again with its right neighbour in view.
    Lookbehinds see the real text before a window.
    """
    if not is_long(text):
        return pattern.search(text, start)
    size = piece_size()
    end = len(text)
    for low in range(start, end, size):
        match = pattern.search(text, low, min(low + size + 1, end))
        if match is not None:
            return match
    return None


def spans(text: str, cut: re.Pattern[str], *, force: bool = False) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive pieces of ``text``, of about ``PIECE_CHARS`` to
    ``2 * PIECE_CHARS`` characters each.

    A piece ends right after a match of ``cut`` (a one-character pattern, as for ``search``),
    which marks a character after which the caller's rules allow a cut. Where a whole window
    holds no such character: with ``force``, the piece is cut at the window's end anyway (the
    caller accepts an approximate result there); without it, the piece runs on to the next
    allowed cut (correct, but one call then covers that whole piece).
    """
    size = piece_size()
    pos = 0
    while len(text) - pos > 2 * size:
        match = cut.search(text, pos + size, pos + 2 * size)
        if match is not None:
            end = match.end()
        elif force:
            end = pos + 2 * size
        else:
            match = search(cut, text, pos + 2 * size)
            if match is None:
                break
            end = match.end()
        yield pos, end
        pos = end
    yield pos, len(text)


def pieces(text: str, cut: re.Pattern[str], *, force: bool = False) -> list[str]:
    """The texts of ``spans(text, cut, force=force)``."""
    return [text[start:end] for start, end in spans(text, cut, force=force)]
