"""Prefill/decode separation: a route whose requests are prefilled on one pool of servers and
decoded on another (`router`), over vLLM's disaggregated-serving protocol (`vllm`, `wire`) or
SGLang's bootstrap protocol (`sglang`). Both protocols build on the router, which knows neither:
`gateway.upstreams.build` gives each route the one it names."""

from gateway.upstreams.pd.router import FALLBACK_REASONS, PDStats, PDTiming, PDUpstream
from gateway.upstreams.pd.wire import (
    PREFILL_REQUEST_PARAMS,
    decode_body,
    kv_params_from,
    prefill_body,
)

__all__ = [
    "FALLBACK_REASONS",
    "PREFILL_REQUEST_PARAMS",
    "PDStats",
    "PDTiming",
    "PDUpstream",
    "decode_body",
    "kv_params_from",
    "prefill_body",
]
