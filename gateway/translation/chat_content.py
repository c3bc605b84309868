"""Walking an OpenAI chat message's `content` for the translators that write it in another
provider's shape (`chat_to_anthropic`, `chat_to_gemini`): the same checks, and the same 400
naming the same field, for the same client mistake whichever provider the route speaks. Each
translator says only what one part becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.translation.errors import TranslationError


def content_parts(
    content: Any,
    where: str,
    text: Callable[[str], dict],
    part: Callable[[dict, str], dict | None],
) -> list[dict]:
    """`content` (a string, a list of parts, or absent) as the provider's parts: a non-empty
    string through `text`, each part object through `part` (None: the part is dropped)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [text(content)] if content else []
    if not isinstance(content, list):
        raise TranslationError("'content' must be a string or a list of parts", f"{where}.content")
    out = []
    for j, item in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(item, dict):
            raise TranslationError("each content part must be an object", at)
        translated = part(item, at)
        if translated is not None:
            out.append(translated)
    return out


def part_text(part: dict, where: str) -> str:
    """A text part's text; a 400 naming it when it is not a string."""
    text = part.get("text")
    if not isinstance(text, str):
        raise TranslationError("a text part needs a string 'text'", f"{where}.text")
    return text
