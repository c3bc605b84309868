"""Split markdown text into prose and fenced code blocks.

Slimming must never touch a fenced code block: trailing spaces and blank lines can be
significant there (diffs, Makefiles, heredocs). An unclosed fence runs to the end of the text,
as in CommonMark, so a truncated block is protected too.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
# Slimming strips these from prose; ignoring them here keeps a fence a fence after slimming.
_DROP_INVISIBLE = str.maketrans("", "", "\u200b\u2060\ufeff")


class Segment(NamedTuple):
    is_code: bool
    text: str
    info: str  # the fence's info string (e.g. "json"), empty for prose


def has_fence(text: str) -> bool:
    return "```" in text or "~~~" in text


def split_fences(text: str) -> list[Segment]:
    """Return consecutive segments whose texts concatenate back to ``text``."""
    if not has_fence(text):
        return [Segment(False, text, "")]
    segments: list[Segment] = []
    prose: list[str] = []
    code: list[str] = []
    fence = ""
    info = ""
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\r\n").translate(_DROP_INVISIBLE)
        if not fence:
            match = _FENCE_OPEN.fullmatch(stripped)
            # A backtick fence's info string may not contain backticks (CommonMark).
            if match and not (match.group(1)[0] == "`" and "`" in match.group(2)):
                if prose:
                    segments.append(Segment(False, "".join(prose), ""))
                    prose = []
                fence = match.group(1)
                info = match.group(2).strip()
                code = [line]
            else:
                prose.append(line)
            continue
        code.append(line)
        closing = stripped.lstrip(" ")
        if (
            len(stripped) - len(closing) <= 3
            and closing.rstrip(" \t") == fence[0] * len(closing.rstrip(" \t"))
            and len(closing.rstrip(" \t")) >= len(fence)
        ):
            segments.append(Segment(True, "".join(code), info))
            fence, code = "", []
    if fence:
        segments.append(Segment(True, "".join(code), info))
    if prose:
        segments.append(Segment(False, "".join(prose), ""))
    return segments


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of ``text`` (fences included), in order."""
    return [segment.text for segment in split_fences(text) if segment.is_code]
