"""Provider prompt-cache rules, kept in one table.

Every route belongs to one *cache family*: the set of rules its provider caches by. The
figures come from the providers' own documentation (see ``shared/docs/provider-caching.md``):

- ``openai`` (OpenAI and OpenAI-compatible hosts): automatic from 1,024 prompt tokens in
  128-token steps; ``prompt_cache_key`` steers requests to one cache machine.
- ``azure`` (Azure OpenAI): OpenAI's rules, but no ``prompt_cache_key`` is added: Azure
  rejects it (400 ``unrecognized_request_argument``) on many models and API versions. A client
  that knows its deployment takes it may still send its own.
- ``deepseek``: automatic, disk-backed, in 64-token units.
- ``moonshot`` (Kimi): automatic; no documented minimum or unit.
- ``anthropic`` (direct, Bedrock InvokeModel, Vertex rawPredict): opt-in ``cache_control``
  breakpoints, at most 4, a 20-block lookback, a minimum cacheable length per model.
- ``bedrock_converse`` (Bedrock's Converse API, non-Anthropic models): opt-in ``cachePoint``
  blocks, only on the models that support prompt caching, with a minimum per model.
- ``gemini`` (AI Studio, Vertex's Google models): implicit, 1,024-4,096 tokens by model.
- ``local``: the bundled engine keeps its own prefix cache.

The cache hints (which marker, if any, a request gets), the canonicalizer and the advisor's
cached-token estimate all read these rules, so a provider's numbers live here only. Providers
change them; check their current documentation before relying on a number.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

OPENAI = "openai"
AZURE = "azure"
DEEPSEEK = "deepseek"
MOONSHOT = "moonshot"
ANTHROPIC = "anthropic"
BEDROCK_CONVERSE = "bedrock_converse"
GEMINI = "gemini"
LOCAL = "local"

OPENAI_MIN_CACHED_TOKENS = 1024
OPENAI_CACHE_STEP_TOKENS = 128
DEEPSEEK_CACHE_UNIT_TOKENS = 64
ANTHROPIC_MAX_BREAKPOINTS = 4
ANTHROPIC_LOOKBACK_BLOCKS = 20
ANTHROPIC_DEFAULT_MIN_TOKENS = 1024
CONVERSE_MAX_CACHE_POINTS = 4

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

# Converse models that accept ``cachePoint`` blocks (Bedrock's "Supported models" table for
# prompt caching), by substring of the model id (region prefixes like ``us.`` and ARNs
# match too), with the minimum tokens before a cache point. Claude's minimums are Anthropic's.
# Amazon documents Nova's as "1K". A model not listed does not cache: it gets no cache point.
CONVERSE_CACHE_POINT_MIN_TOKENS: tuple[tuple[str, int], ...] = (
    ("amazon.nova-micro", 1000),
    ("amazon.nova-lite", 1000),
    ("amazon.nova-pro", 1000),
    ("amazon.nova-premier", 1000),
    ("amazon.nova-2-lite", 1000),
)

# Gemini's implicit caching minimum by model, matched by substring, most specific first.
GEMINI_MIN_TOKENS: tuple[tuple[str, int], ...] = (
    ("gemini-3-pro", 4096),
    ("gemini-3-flash", 1024),
    ("gemini-2.5-pro", 4096),
    ("gemini-2.5-flash", 1024),
)
GEMINI_DEFAULT_MIN_TOKENS = 4096  # unknown or older models: the strictest documented figure

# Hosts of OpenAI-compatible APIs whose cache follows other rules than OpenAI's.
_FAMILY_BY_HOST: dict[str, str] = {
    "api.deepseek.com": DEEPSEEK,
    "api.moonshot.cn": MOONSHOT,
    "api.moonshot.ai": MOONSHOT,
}


@dataclass(frozen=True)
class FamilyRules:
    """How one family caches. ``marker`` is what the cache hints add: ``prompt_cache_key``,
    ``cache_control`` (Anthropic breakpoints), ``cache_point`` (Converse blocks) or None (the
    provider caches on its own). ``late_system``: the provider's chat API takes a system
    message after the first turn (where the canonicalizer's volatile note may go; elsewhere
    the note is a user message)."""

    name: str
    marker: str | None
    min_tokens: int  # the default minimum; ``min_cacheable_tokens`` refines it per model
    step_tokens: int  # the cached part grows in these units
    late_system: bool = False


CACHE_FAMILIES: dict[str, FamilyRules] = {
    OPENAI: FamilyRules(OPENAI, "prompt_cache_key", OPENAI_MIN_CACHED_TOKENS, 128, True),
    AZURE: FamilyRules(AZURE, None, OPENAI_MIN_CACHED_TOKENS, OPENAI_CACHE_STEP_TOKENS, True),
    DEEPSEEK: FamilyRules(
        DEEPSEEK, None, DEEPSEEK_CACHE_UNIT_TOKENS, DEEPSEEK_CACHE_UNIT_TOKENS, True
    ),
    MOONSHOT: FamilyRules(MOONSHOT, None, 1, 1, True),
    ANTHROPIC: FamilyRules(ANTHROPIC, "cache_control", ANTHROPIC_DEFAULT_MIN_TOKENS, 1),
    BEDROCK_CONVERSE: FamilyRules(BEDROCK_CONVERSE, "cache_point", 1000, 1),
    GEMINI: FamilyRules(GEMINI, None, GEMINI_DEFAULT_MIN_TOKENS, 1),
    LOCAL: FamilyRules(LOCAL, None, 1, 1),
}
FAMILY_NAMES: tuple[str, ...] = tuple(CACHE_FAMILIES)


def _match(table: tuple[tuple[str, int], ...], name: str) -> int | None:
    for fragment, minimum in table:
        if fragment in name:
            return minimum
    return None


@functools.lru_cache(maxsize=256)  # a route's base URL, on every request: parse it once
def _host(base_url: str | None) -> str:
    if not base_url:
        return ""
    try:
        return (urlsplit(base_url).hostname or "").lower()
    except ValueError:
        return ""


def cache_family(route_kind: str, model: str, base_url: str | None = None) -> str:
    """The cache family of a route kind serving ``model`` at ``base_url``.

    An ``openai`` route to DeepSeek's or Moonshot's API is told apart by its host. Unknown
    kinds are treated as OpenAI-compatible, whose rules are the common ones."""
    name = model.lower()
    if route_kind == "anthropic":
        return ANTHROPIC
    if route_kind == "local":
        return LOCAL
    if route_kind == "bedrock":
        return ANTHROPIC if "anthropic." in name else BEDROCK_CONVERSE
    if route_kind == "vertex":
        return ANTHROPIC if name.startswith("claude") else GEMINI
    if route_kind == "gemini":
        return GEMINI
    if route_kind == "azure":
        return AZURE
    return _FAMILY_BY_HOST.get(_host(base_url), OPENAI)


def anthropic_min_tokens(model: str) -> int:
    found = _match(ANTHROPIC_MIN_TOKENS, model.lower().replace(".", "-"))
    return ANTHROPIC_DEFAULT_MIN_TOKENS if found is None else found


def converse_cache_point_min_tokens(model: str) -> int | None:
    """Tokens a Converse prefix needs before a cache point; None: the model does not cache."""
    name = model.lower()
    if "anthropic.claude" in name:
        return anthropic_min_tokens(name.split("anthropic.", 1)[1])
    return _match(CONVERSE_CACHE_POINT_MIN_TOKENS, name)


def gemini_min_tokens(model: str) -> int:
    found = _match(GEMINI_MIN_TOKENS, model.lower())
    return GEMINI_DEFAULT_MIN_TOKENS if found is None else found


def min_cacheable_tokens(family: str, model: str) -> int | None:
    """The shortest prefix ``family`` caches for ``model``; None when it never caches."""
    if family == ANTHROPIC:
        return anthropic_min_tokens(model)
    if family == BEDROCK_CONVERSE:
        return converse_cache_point_min_tokens(model)
    if family == GEMINI:
        return gemini_min_tokens(model)
    rules = CACHE_FAMILIES.get(family)
    return None if rules is None else rules.min_tokens


def openai_cached_tokens(matching_prefix_tokens: int) -> int:
    """Tokens OpenAI reports as cached for a given exact-prefix match length."""
    if matching_prefix_tokens < OPENAI_MIN_CACHED_TOKENS:
        return 0
    steps = (matching_prefix_tokens - OPENAI_MIN_CACHED_TOKENS) // OPENAI_CACHE_STEP_TOKENS
    return OPENAI_MIN_CACHED_TOKENS + steps * OPENAI_CACHE_STEP_TOKENS


def cached_tokens(family: str, model: str, stable_prefix_tokens: int) -> int:
    """Tokens ``family`` would report as cached when the first ``stable_prefix_tokens`` of a
    prompt repeat an earlier one.

    For the breakpoint families (Anthropic, Converse) this is an upper bound: they read only
    at a breakpoint inside the stable prefix, and the whole stable prefix is counted."""
    minimum = min_cacheable_tokens(family, model)
    if minimum is None or stable_prefix_tokens < minimum or stable_prefix_tokens <= 0:
        return 0
    if family in (OPENAI, AZURE):
        return openai_cached_tokens(stable_prefix_tokens)
    step = CACHE_FAMILIES[family].step_tokens
    return stable_prefix_tokens // step * step
