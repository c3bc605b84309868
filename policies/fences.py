"""Split markdown text into prose and fenced code blocks.

Slimming must never touch a fenced code block: trailing spaces and blank lines can be
significant there (diffs, Makefiles, heredocs). An unclosed fence runs to the end of the text,
as in CommonMark, so a truncated block is protected too.

Work is linear and bounded: a long text's lines are read in chunks (no one ``splitlines`` call
covers megabytes of short lines), segments are slices of the text, and only a line that starts
like a fence is examined further.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from policies import textscan

_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
_FENCE_CLOSE = re.compile(r" {0,3}(`++|~++)[ \t]*+")
# A line can open or close a fence only if it starts like this (up to three spaces, invisibles
# anywhere, then a backtick or a tilde); other lines skip the full check.
_MAY_FENCE = re.compile("(?:[\u200b\u2060\ufeff]*+ ){0,3}[\u200b\u2060\ufeff]*+[`~]")
# Slimming strips these from prose; ignoring them here keeps a fence a fence after slimming.
_DROP_INVISIBLE = str.maketrans("", "", "\u200b\u2060\ufeff")
# Characters that end a line for str.splitlines ("\r" only when no "\n" follows it).
_LINE_END = re.compile("[\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029](?:(?<!\r)|(?=[^\n]))")


class Segment(NamedTuple):
    is_code: bool
    text: str
    info: str  # the fence's info string (e.g. "json"), empty for prose


def has_fence(text: str) -> bool:
    return textscan.contains(text, "```") or textscan.contains(text, "~~~")


def _line_chunks(text: str) -> list[str]:
    """``text`` in chunks that end at line ends, so that no one ``splitlines`` call is huge."""
    return textscan.pieces(text, _LINE_END) if textscan.is_long(text) else [text]


def split_fences(text: str) -> list[Segment]:
    """Return consecutive segments whose texts concatenate back to ``text``."""
    if not has_fence(text):
        return [Segment(False, text, "")]
    segments: list[Segment] = []
    start = 0  # where the current segment starts
    end = 0  # where the current line ends
    fence = ""
    info = ""
    for chunk in _line_chunks(text):
        for line in chunk.splitlines(keepends=True):
            line_start, end = end, end + len(line)
            if not _MAY_FENCE.match(line):
                continue
            stripped = line.rstrip("\r\n").translate(_DROP_INVISIBLE)
            if not fence:
                match = _FENCE_OPEN.fullmatch(stripped)
                # A backtick fence's info string may not contain backticks (CommonMark).
                if match and not (match.group(1)[0] == "`" and "`" in match.group(2)):
                    if line_start > start:
                        segments.append(Segment(False, text[start:line_start], ""))
                    start = line_start
                    fence = match.group(1)
                    info = match.group(2).strip()
                continue
            closing = _FENCE_CLOSE.fullmatch(stripped)
            if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence):
                segments.append(Segment(True, text[start:end], info))
                start, fence = end, ""
    if start < len(text):
        segments.append(Segment(bool(fence), text[start:], info if fence else ""))
    return segments


def outer_lines(text: str) -> tuple[str, str] | None:
    """The first and the last line of ``text`` (line ends kept); None if it has under 3 lines."""
    first = last = ""
    lines = 0
    for chunk in _line_chunks(text):
        chunk_lines = chunk.splitlines(keepends=True)
        if chunk_lines:
            first = first or chunk_lines[0]
            last = chunk_lines[-1]
            lines += len(chunk_lines)
    return (first, last) if lines >= 3 else None
