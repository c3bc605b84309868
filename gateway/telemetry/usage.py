"""Usage counts from an upstream, which is untrusted input, in OpenAI's shape.

Every provider reports cached prompt tokens in its own field. The client of the chat API, the
telemetry record, Prometheus, the dashboard and the advisor all read OpenAI's
``usage.prompt_tokens_details.cached_tokens``, so the one table below says where each provider
puts that number, and ``chat_usage`` fills OpenAI's field from it (the provider's own fields
stay beside it). Providers whose usage is not chat-shaped at all have a converter each:
``from_anthropic`` here (direct, Bedrock InvokeModel and Vertex share it), Converse's and
Gemini's beside their translations (``gateway.translation.converse_to_chat``,
``gemini_to_chat``).

Every count is checked: anything but a non-negative integer up to ``MAX_TOKEN_COUNT`` counts
as 0, alone, and no field of the wrong type raises.
"""

from __future__ import annotations

from typing import Any

# A token count above this is not a count (and would overflow a Redis counter in time).
MAX_TOKEN_COUNT = 1 << 40

# Where the providers that speak OpenAI's chat API (OpenAI-compatible routes, Azure) report
# cached prompt tokens in `usage`, as a path of keys. OpenAI's own field comes first; the others
# are read only when present, and the largest valid count wins.
CHAT_CACHED_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # OpenAI, Azure OpenAI, Groq, xAI, vLLM, SGLang, newer DeepSeek answers
    ("openai", ("prompt_tokens_details", "cached_tokens")),
    # DeepSeek (with `prompt_cache_miss_tokens`; older answers have no prompt_tokens_details)
    ("deepseek", ("prompt_cache_hit_tokens",)),
    # Moonshot / Kimi
    ("moonshot", ("cached_tokens",)),
)
_PROVIDER_FIELDS = tuple(path for name, path in CHAT_CACHED_FIELDS if name != "openai")
_OPENAI_PATH = CHAT_CACHED_FIELDS[0][1]


def token_count(value: Any) -> int:
    """A usage field from upstream: anything but a non-negative integer (a string, a float, a
    negative or absurd number, nested junk) counts as 0, alone."""
    if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return 0


def _at(usage: dict, path: tuple[str, ...]) -> Any:
    value: Any = usage
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def chat_usage(usage: dict) -> dict:
    """``usage`` (chat-shaped, from any OpenAI-compatible provider) with
    ``prompt_tokens_details.cached_tokens`` filled from the provider's own field.

    The same object when there is nothing to fill (OpenAI's answers, or a provider that reports
    no cached count), so a caller can tell by identity whether to re-encode anything."""
    found = [_at(usage, path) for path in _PROVIDER_FIELDS]
    if all(value is None for value in found):
        return usage
    details = usage.get("prompt_tokens_details")
    reported = _at(usage, _OPENAI_PATH)
    cached = max(token_count(value) for value in (reported, *found))
    prompt = token_count(usage.get("prompt_tokens"))
    if prompt:
        cached = min(cached, prompt)
    if type(reported) is int and reported == cached:
        return usage
    filled = {**details, "cached_tokens": cached} if isinstance(details, dict) else None
    return {**usage, "prompt_tokens_details": filled or {"cached_tokens": cached}}


def chunk_usage(chunk: dict) -> dict | None:
    """A chat chunk's (or completion's) usage in OpenAI's shape, or None when it has none.

    Moonshot's older streams put usage on the choice (``choices[0].usage``) rather than on the
    chunk; it is read from there when the chunk has none of its own."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        return chat_usage(usage)
    if usage is None:
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                inner = choice.get("usage") if isinstance(choice, dict) else None
                if isinstance(inner, dict):
                    return chat_usage(inner)
    return None


def with_chat_usage(chunk: dict) -> dict | None:
    """``chunk`` with its usage in OpenAI's shape at the top level, or None when it already
    is (nothing to rewrite: the common case, checked without copying)."""
    usage = chunk_usage(chunk)
    if usage is None or usage is chunk.get("usage"):
        return None
    return {**chunk, "usage": usage}


def from_anthropic(usage: Any) -> dict:
    """Anthropic usage (direct, Bedrock InvokeModel, Vertex rawPredict) -> OpenAI usage, with
    the cache-write count kept visible. Anthropic's ``input_tokens`` counts only what follows
    the last breakpoint, so the prompt is the sum of the three."""
    usage = usage if isinstance(usage, dict) else {}
    fresh = token_count(usage.get("input_tokens"))
    cache_read = token_count(usage.get("cache_read_input_tokens"))
    cache_write = token_count(usage.get("cache_creation_input_tokens"))
    prompt = fresh + cache_read + cache_write
    completion = token_count(usage.get("output_tokens"))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cache_read, "cache_write_tokens": cache_write},
        "cache_creation_input_tokens": cache_write,
    }


def cached_prompt_tokens(usage: Any) -> int:
    """The cached prompt tokens of a chat-shaped usage, whichever provider's field says it."""
    if not isinstance(usage, dict):
        return 0
    return token_count(_at(chat_usage(usage), _OPENAI_PATH))
