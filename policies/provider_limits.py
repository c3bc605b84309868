"""Provider prompt-cache numbers, kept in one table.

The figures come from the providers' own documentation: OpenAI's "Prompt caching" guide
(caching starts at 1,024 prompt tokens and grows in 128-token steps) and Anthropic's
"Prompt caching" docs (at most 4 cache breakpoints, a 20-block lookback, and a minimum
cacheable length per model family). Providers change these; check their current
documentation before relying on a number.

The Anthropic numbers shape the cache hints the policies add. The OpenAI ones are not used
on the request path: they model what OpenAI reports as cached, for the cache-hit simulation
(`bench/cache_hit.py`) and the tests.
"""

from __future__ import annotations

OPENAI_MIN_CACHED_TOKENS = 1024
OPENAI_CACHE_STEP_TOKENS = 128
ANTHROPIC_MAX_BREAKPOINTS = 4
ANTHROPIC_LOOKBACK_BLOCKS = 20
ANTHROPIC_DEFAULT_MIN_TOKENS = 1024

# Minimum cacheable prompt length per Anthropic model family, matched by substring of the model
# name, most specific first. Unknown models get the default.
ANTHROPIC_MIN_TOKENS: tuple[tuple[str, int], ...] = (
    ("opus-4-5", 4096),
    ("haiku-4-5", 4096),
    ("haiku-3-5", 2048),
    ("3-5-haiku", 2048),
    ("3-haiku", 2048),
    ("haiku-3", 2048),
    ("opus", 1024),
    ("sonnet", 1024),
)


def anthropic_min_tokens(model: str) -> int:
    name = model.lower().replace(".", "-")
    for fragment, minimum in ANTHROPIC_MIN_TOKENS:
        if fragment in name:
            return minimum
    return ANTHROPIC_DEFAULT_MIN_TOKENS


def openai_cached_tokens(matching_prefix_tokens: int) -> int:
    """Tokens OpenAI reports as cached for a given exact-prefix match length."""
    if matching_prefix_tokens < OPENAI_MIN_CACHED_TOKENS:
        return 0
    steps = (matching_prefix_tokens - OPENAI_MIN_CACHED_TOKENS) // OPENAI_CACHE_STEP_TOKENS
    return OPENAI_MIN_CACHED_TOKENS + steps * OPENAI_CACHE_STEP_TOKENS
