"""Retrieved passages marked by the client, and the two things policies do with them.

Marking convention: a client wraps each retrieved passage (a RAG chunk, a memory) in a
``<passage>`` element inside any text content, optionally with attributes::

    <passage id="doc-7#3" source="handbook.md">Refunds are processed within 5 days.</passage>

Plain text markers were chosen over an extra JSON key on content parts because they survive
every provider unchanged (an unknown key may be rejected) and the model reads them as structure.

- ``sort_passage_runs`` (canonicalize opt-in): retrieval returns the same chunks in a different
  order from request to request, which breaks the prefix at the first chunk. Each run of
  adjacent passages (separated only by whitespace) is put into a stable order by content.
  The separators stay where they were; nothing outside a run moves.
- ``dedupe_passages`` (slim opt-in): a passage whose body already appeared earlier in the
  conversation is replaced by a short stub that keeps its attributes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

from policies import textscan

_OPEN = re.compile(r"<passage\b")
_CLOSE = "</passage>"
REPEATED_BODY = "(same as above)"


class Passage(NamedTuple):
    """One ``<passage ...>body</passage>`` element: where it is and its two parts."""

    start: int
    end: int
    attributes: str  # what stands between "<passage" and ">"
    body: str

    def element(self, text: str) -> str:
        return text[self.start : self.end]

    def open_tag(self, text: str) -> str:
        return text[self.start : self.end - len(self.body) - len(_CLOSE)]


def has_passage(text: str) -> bool:
    return textscan.contains(text, "<passage")


def find_passages(text: str) -> Iterator[Passage]:
    """What ``re.finditer(r"<passage\\b([^>]*)>(.*?)</passage>", text, re.DOTALL)`` finds, in
    linear time: that regex rescanned the rest of the text from every unclosed ``<passage``.

    Once no ``>`` or no closing tag follows an opening, none follows any later one either.
    """
    pos = 0
    while True:
        found = _OPEN.search(text, pos)
        if found is None:
            return
        close_angle = text.find(">", found.end())
        if close_angle < 0:
            return
        close = text.find(_CLOSE, close_angle + 1)
        if close < 0:
            return
        end = close + len(_CLOSE)
        attributes = text[found.end() : close_angle]
        yield Passage(found.start(), end, attributes, text[close_angle + 1 : close])
        pos = end


def sort_passage_runs(text: str) -> str:
    if not has_passage(text):
        return text
    matches = list(find_passages(text))
    if len(matches) < 2:
        return text
    pieces: list[str] = []
    cursor = 0
    run: list[Passage] = []

    def flush() -> None:
        nonlocal cursor
        if not run:
            return
        ordered = sorted(run, key=lambda m: (m.body, m.element(text)))
        for index, original in enumerate(run):
            if index:
                pieces.append(text[run[index - 1].end : original.start])
            pieces.append(ordered[index].element(text))
        cursor = run[-1].end
        run.clear()

    for match in matches:
        if run and text[run[-1].end : match.start].strip() == "":
            run.append(match)
            continue
        flush()
        pieces.append(text[cursor : match.start])
        run.append(match)
    flush()
    pieces.append(text[cursor:])
    return "".join(pieces)


def passage_deduper() -> Callable[[str], str]:
    """A rewrite function that remembers passage bodies across the texts it is applied to.

    Apply it to the conversation's texts in order; the first occurrence of a body is kept.
    """
    seen: set[str] = set()

    def rewrite(text: str) -> str:
        if not has_passage(text):
            return text
        pieces: list[str] = []
        cursor = 0
        for match in find_passages(text):
            body = match.body.strip()
            if body == REPEATED_BODY or not body:
                continue
            if body not in seen:
                seen.add(body)
                continue
            pieces.append(text[cursor : match.start])
            pieces.append(f"<passage{match.attributes}>{REPEATED_BODY}</passage>")
            cursor = match.end
        if not pieces:
            return text
        pieces.append(text[cursor:])
        return "".join(pieces)

    return rewrite
