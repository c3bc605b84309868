"""slim: fewer prompt tokens, same meaning by default.

Safe rules, applied to all text content outside fenced code blocks: remove trailing spaces and
tabs on lines, collapse runs of 3+ blank lines to 2, strip zero-width spaces, word joiners and
byte-order marks. The zero-width *joiner* and *non-joiner* are kept: they change how emoji
sequences and Persian or Indic scripts render. Then drop messages whose content is empty (never
one that carries tool calls, never a tool result, never the last message) and collapse exact
duplicate consecutive messages of the same role. Tool-call arguments are never touched.

Opt-ins: minify JSON in tool results and in ```json blocks (whitespace only: numbers, escapes and
key order stay byte-for-byte), deduplicate retrieved passages (see ``policies.passages``), and
trim history to a token budget (see ``policies.trim``).

Messages and Responses bodies are slimmed through their chat-shaped view (``policies.shapes``):
their text blocks and ``input_text``/``output_text`` parts get the same rules; tool_use,
tool_result and thinking blocks and non-message Responses items are payload, never dropped,
collapsed or rewritten (so minify_json does not reach their tool results). History trimming is
chat-only: its units are chat's tool rounds (an assistant ``tool_calls`` message and its ``tool``
results), which these shapes do not have, so a cut could separate a tool_use from its
tool_result (or a function_call from its output) and the provider would reject the request.
"""

from __future__ import annotations

import json
import re
from typing import Any

from policies.config import SlimOptions
from policies.fences import Segment, has_fence, outer_lines, split_fences
from policies.lru import BoundedLRU
from policies.passages import passage_deduper
from policies.prose import slim_prose
from policies.request import (
    carries_payload,
    is_empty_content,
    is_item,
    map_message_text,
    messages_of,
    role_of,
    tools_of,
)
from policies.shapes import NATIVE_ENDPOINTS
from policies.tokens import count_tool
from policies.trim import trim_history
from policies.volatile import is_volatile_note

# A JSON string (possessive: the old alternation backtracked through megabyte strings) or a
# whitespace run; only ever run over text that json.loads accepted.
_JSON_WHITESPACE = re.compile(r'("(?:[^"\\]++|\\.)*+")|[ \t\n\r]++')

_slim_cache: BoundedLRU[str] = BoundedLRU(max_entries=100_000, max_weight=32_000_000)
_minify_cache: BoundedLRU[str] = BoundedLRU(max_entries=20_000, max_weight=16_000_000)


def slim_text(text: str) -> str:
    """The safe text rules; fenced code blocks are returned byte-for-byte."""
    cached = _slim_cache.get(text)
    if cached is not None:
        return cached
    if has_fence(text):
        result = "".join(s.text if s.is_code else slim_prose(s.text) for s in split_fences(text))
    else:
        result = slim_prose(text)
    _slim_cache.put(text, result, len(text))
    return result


def minify_json_text(text: str) -> str:
    """Remove insignificant whitespace from ``text`` if it is a JSON document; else return it."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return text
    cached = _minify_cache.get(text)
    if cached is not None:
        return cached
    try:
        json.loads(stripped)
    except (ValueError, RecursionError):  # nesting deeper than the parser's recursion limit
        result = text
    else:
        result = _JSON_WHITESPACE.sub(lambda m: m.group(1) or "", stripped)
    _minify_cache.put(text, result, len(text))
    return result


def _minify_json_blocks(text: str) -> str:
    if not has_fence(text):
        return text
    pieces = []
    for segment in split_fences(text):
        pieces.append(_minify_code_segment(segment) if segment.is_code else segment.text)
    return "".join(pieces)


def _minify_code_segment(segment: Segment) -> str:
    if segment.info.lower() != "json":
        return segment.text
    lines = outer_lines(segment.text)
    if lines is None:
        return segment.text
    first, last = lines
    body = segment.text[len(first) : len(segment.text) - len(last)]
    minified = minify_json_text(body)
    if minified == body:
        return segment.text
    newline = "\r\n" if first.endswith("\r\n") else "\n"
    return first + minified + newline + last


def _droppable(message: Any, is_last: bool) -> bool:
    if is_last or not isinstance(message, dict):
        return False
    if role_of(message) not in ("system", "developer", "user", "assistant"):
        return False
    if carries_payload(message):
        return False
    return is_empty_content(message.get("content"))


def _is_duplicate(previous: Any, message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message == previous
        and role_of(message) != "tool"
        and not carries_payload(message)
    )


class SlimPolicy:
    name = "slim"

    def __init__(self, options: SlimOptions) -> None:
        self.options = options

    def apply(self, body: dict, ctx: Any) -> tuple[dict, dict]:
        notes: dict[str, Any] = {}
        messages = messages_of(body)
        if messages is None:
            return self._apply_prompt(body), notes
        slimmed: list[Any] = []
        for message in messages:
            if is_item(message):
                slimmed.append(message)
                continue
            message = map_message_text(message, slim_text)
            if self.options.minify_json:
                rewrite = minify_json_text if role_of(message) == "tool" else _minify_json_blocks
                message = map_message_text(message, rewrite)
            slimmed.append(message)
        # Trimming is chat-only (see the module docstring).
        native = getattr(ctx, "endpoint", "chat") in NATIVE_ENDPOINTS
        budget = None if native else self.options.max_prompt_tokens
        kept, trimmed = self._settle(slimmed, body, notes, budget)
        if trimmed:
            notes["trimmed_messages"] = trimmed
        return {**body, "messages": kept}, notes

    def _settle(
        self, messages: list[Any], body: dict, notes: dict[str, Any], budget: int | None
    ) -> tuple[list[Any], int]:
        """Drop and collapse, deduplicate passages, trim; repeat until trimming drops nothing.

        Deduplicating before trimming makes the budget count what is sent; repeating after a
        trim keeps a stub from pointing at a dropped passage and collapses duplicates a trim made
        adjacent, which is what makes slim idempotent. Each round that repeats drops a message,
        so the loop ends.
        """
        tools_tokens = sum(count_tool(tool) for tool in tools_of(body) or ()) if budget else 0
        trimmed = 0
        while True:
            messages = self._drop_and_collapse(messages, notes)
            current = messages
            if self.options.dedupe_passages:
                dedupe = passage_deduper()
                current = [
                    message if is_item(message) else map_message_text(message, dedupe)
                    for message in messages
                ]
            if budget is None:
                return current, trimmed
            dropped = trim_history(current, tools_tokens, budget)
            if not dropped:
                return current, trimmed
            trimmed += len(dropped)
            messages = [message for index, message in enumerate(messages) if index not in dropped]

    @staticmethod
    def _drop_and_collapse(messages: list[Any], notes: dict[str, Any]) -> list[Any]:
        # The volatile note, when a previous pass added it, does not count as the last message.
        last = len(messages) - 1
        while last > 0 and is_volatile_note(messages[last]):
            last -= 1
        kept: list[Any] = []
        dropped_empty = collapsed = 0
        for index, message in enumerate(messages):
            if _droppable(message, index == last):
                dropped_empty += 1
                continue
            if kept and _is_duplicate(kept[-1], message):
                collapsed += 1
                continue
            kept.append(message)
        if dropped_empty:
            notes["dropped_empty"] = notes.get("dropped_empty", 0) + dropped_empty
        if collapsed:
            notes["collapsed_duplicates"] = notes.get("collapsed_duplicates", 0) + collapsed
        return kept

    def _apply_prompt(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return {**body, "prompt": slim_text(prompt)}
        if isinstance(prompt, list) and all(isinstance(item, str) for item in prompt):
            return {**body, "prompt": [slim_text(item) for item in prompt]}
        return dict(body)


__all__ = ["SlimPolicy", "minify_json_text", "slim_text"]
