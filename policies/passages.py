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
from collections.abc import Callable

_PASSAGE = re.compile(r"<passage\b([^>]*)>(.*?)</passage>", re.DOTALL)
REPEATED_BODY = "(same as above)"


def has_passage(text: str) -> bool:
    return "<passage" in text


def sort_passage_runs(text: str) -> str:
    if not has_passage(text):
        return text
    matches = list(_PASSAGE.finditer(text))
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
                pieces.append(text[run[index - 1].end():original.start()])
            pieces.append(ordered[index].group(0))
        cursor = run[-1].end()
        run.clear()

    for match in matches:
        if run and text[run[-1].end():match.start()].strip() == "":
            run.append(match)
            continue
        flush()
        pieces.append(text[cursor:match.start()])
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

        def replace(match: re.Match[str]) -> str:
            body = match.group(2).strip()
            if body == REPEATED_BODY or not body:
                return match.group(0)
            if body in seen:
                return f"<passage{match.group(1)}>{REPEATED_BODY}</passage>"
            seen.add(body)
            return match.group(0)

        return _PASSAGE.sub(replace, text)

    return rewrite
