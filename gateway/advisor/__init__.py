"""The cache advisor: which policy opt-in would pay, measured in shadow on real traffic.

For each tenant and prefix family the gateway already fingerprints the request after its
policies (the prefix-break diagnostics). The advisor also fingerprints the request as each
opt-in would have rewritten it, and counts how many prompt tokens would have been a prefix hit
under the provider's caching rules with and without each one (``accounting``). The counters
live in the telemetry store (in process, or Redis); ``gateway.ops.advice`` serves them as
advice (``advice``). The advisor only observes: nothing it does changes what is sent.
"""

from .accounting import CacheRules, decode_history, encode_history, evaluate, field_names
from .advice import PREFILL_MS_PER_TOKEN, PRICES, family_advice, tenant_advice
from .shadow import CacheAdvisor, advisor_for, bucket_of, observe_cache_advice
from .variants import ALL_OPT_INS, OBSERVED, OPT_INS, VARIANTS, ShadowChains, guess_route

__all__ = [
    "ALL_OPT_INS",
    "OBSERVED",
    "OPT_INS",
    "PREFILL_MS_PER_TOKEN",
    "PRICES",
    "VARIANTS",
    "CacheAdvisor",
    "CacheRules",
    "ShadowChains",
    "advisor_for",
    "bucket_of",
    "decode_history",
    "encode_history",
    "evaluate",
    "family_advice",
    "field_names",
    "guess_route",
    "observe_cache_advice",
    "tenant_advice",
]
