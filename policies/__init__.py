"""Pure, synchronous request policies: slim, canonicalize, cache_hints, and prefix diagnostics.

The gateway builds one chain at start-up (``build_chain(parse_policy_list(...), options)``) and
calls ``chain.apply(body, ctx)`` per request. Nothing here does I/O or imports the gateway.
"""

from policies.cache_hints import prefix_family_key
from policies.chain import PolicyChain, PolicyContext, PolicyResult, build_chain
from policies.config import (
    DEFAULT_POLICIES,
    KNOWN_OPTIONS,
    POLICY_NAMES,
    PolicyConfigError,
    PolicyOptions,
    parse_options,
    parse_policy_list,
)
from policies.diagnostics import (
    PrefixBreak,
    PrefixFingerprints,
    find_prefix_break,
    stable_prefix_tokens,
)
from policies.readable import PolicyShapeError
from policies.tokens import count_request_tokens


def clear_caches() -> None:
    """Forget every content-keyed cache (token counts, slimmed texts, block fingerprints,
    decoded histories, family keys).

    Only benchmarks need this, to measure the path a never-seen conversation takes.
    """
    from policies import cache_hints, diagnostics, prefix_breaks, slim, tokens, volatile

    tokens.clear_caches()
    slim._slim_cache.clear()
    slim._minify_cache.clear()
    diagnostics._block_cache.clear()
    diagnostics._decoded.clear()
    prefix_breaks._decoded_histories.clear()
    volatile._finds.clear()
    cache_hints._family_keys.clear()


__all__ = [
    "DEFAULT_POLICIES",
    "KNOWN_OPTIONS",
    "POLICY_NAMES",
    "PolicyChain",
    "PolicyConfigError",
    "PolicyContext",
    "PolicyOptions",
    "PolicyResult",
    "PolicyShapeError",
    "PrefixBreak",
    "PrefixFingerprints",
    "build_chain",
    "clear_caches",
    "count_request_tokens",
    "find_prefix_break",
    "parse_options",
    "parse_policy_list",
    "prefix_family_key",
    "stable_prefix_tokens",
]
