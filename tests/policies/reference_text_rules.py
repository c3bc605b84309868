"""The text rules as they were before they were made linear (regexes over the whole text).

Kept only as a reference: property tests check that the linear, piecewise versions in
``policies`` give byte-identical results on small inputs, where these are still fast.
"""

from __future__ import annotations

import re
from typing import NamedTuple

TRAILING_SPACE = re.compile(r"[ \t]+(?=\r?\n|\Z)")
BLANK_RUN = re.compile(r"(?:\r?\n){4,}")
INVISIBLE = re.compile("[\u200b\u2060\ufeff]")
JSON_WHITESPACE = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\r]+')
PASSAGE = re.compile(r"<passage\b([^>]*)>(.*?)</passage>", re.DOTALL)
PASSAGE_BODY = re.compile(r"(<passage\b[^>]*>).*?(</passage>)", re.DOTALL)
VOLATILE = re.compile(
    r"(?P<time>\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?"
    r"(?:Z|[+-]\d{2}:?\d{2})?(?!\d))"
    r"|(?P<id>\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)"
    r"|(?P<date>\b\d{4}-\d{2}-\d{2}\b"
    r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2}, \d{4}\b)"
    r"|(?P<clock>\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b)"
    r"|(?P<hex>\b[0-9a-fA-F]{12,}\b)"
)
_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
_DROP_INVISIBLE = str.maketrans("", "", "\u200b\u2060\ufeff")


def slim_prose(text: str) -> str:
    if INVISIBLE.search(text):
        text = INVISIBLE.sub("", text)
    if " " in text or "\t" in text:
        text = TRAILING_SPACE.sub("", text)
    if "\n\n\n\n" in text or "\r\n\r\n\r\n\r\n" in text:
        text = BLANK_RUN.sub(lambda m: ("\r\n" if m.group(0).startswith("\r") else "\n") * 3, text)
    return text


class Segment(NamedTuple):
    is_code: bool
    text: str
    info: str


def split_fences(text: str) -> list[Segment]:
    if not ("```" in text or "~~~" in text):
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


def volatile_matches(text: str) -> list[tuple[int, int, str | None]]:
    return [(m.start(), m.end(), m.lastgroup) for m in VOLATILE.finditer(text)]


def sort_passage_runs(text: str) -> str:
    if "<passage" not in text:
        return text
    matches = list(PASSAGE.finditer(text))
    if len(matches) < 2:
        return text
    pieces: list[str] = []
    cursor = 0
    run: list[re.Match[str]] = []

    def flush() -> None:
        nonlocal cursor
        if not run:
            return
        ordered = sorted(run, key=lambda m: (m.group(2), m.group(0)))
        for index, original in enumerate(run):
            if index:
                pieces.append(text[run[index - 1].end() : original.start()])
            pieces.append(ordered[index].group(0))
        cursor = run[-1].end()
        run.clear()

    for match in matches:
        if run and text[run[-1].end() : match.start()].strip() == "":
            run.append(match)
            continue
        flush()
        pieces.append(text[cursor : match.start()])
        run.append(match)
    flush()
    pieces.append(text[cursor:])
    return "".join(pieces)


def dedupe_passages(texts: list[str]) -> list[str]:
    seen: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        body = match.group(2).strip()
        if body == "(same as above)" or not body:
            return match.group(0)
        if body in seen:
            return f"<passage{match.group(1)}>(same as above)</passage>"
        seen.add(body)
        return match.group(0)

    return [PASSAGE.sub(replace, text) if "<passage" in text else text for text in texts]


def without_passage_bodies(text: str) -> str:
    return PASSAGE_BODY.sub(r"\1\2", text)


def minify_json_body(text: str) -> str:
    return JSON_WHITESPACE.sub(lambda m: m.group(1) or "", text)


def outer_lines(text: str) -> tuple[str, str] | None:
    lines = text.splitlines(keepends=True)
    return (lines[0], lines[-1]) if len(lines) >= 3 else None
