"""From the advisor's counters to advice: shares, gains, and what they would save.

Everything here is an estimate, and the answer says so:

- Prices are list prices in USD per million input tokens, one model per cache family (the
  figures of ``bench/cache_hit.py``'s ``PRICES``: gpt-4.1 for OpenAI-rule routes,
  claude-sonnet-4 for Anthropic ones; the others named in ``PRICES``), not the tenant's
  bill; Anthropic's cache writes (1.25x) are left out, so its savings are an upper bound.
  Pass other ``prices`` to ``tenant_advice`` to change them.
- TTFT saved assumes ``PREFILL_MS_PER_TOKEN`` ms of prefill per prompt token no longer
  computed: vLLM's prefix-caching figure in ``docs/ttft-techniques.md`` of the shared docs
  (a 10k-token prompt on a 32B model, 4.3 s cold and 0.6 s cached: 3.7 s / 10,000 tokens).
  Hosted providers differ; read it as an order of magnitude.
- Per-day figures scale what the window saw to 86,400 seconds.
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.config import ENV_PREFIX

from .variants import ALL_OPT_INS, OBSERVED, OPT_INS, VARIANTS

PRICES: dict[str, dict[str, float]] = {
    "openai": {"input": 2.00, "cached": 0.50},  # gpt-4.1
    "azure": {"input": 2.00, "cached": 0.50},  # gpt-4.1, Azure's global standard deployment
    "anthropic": {"input": 3.00, "cached": 0.30},  # claude-sonnet-4, cache read
    "deepseek": {"input": 0.28, "cached": 0.028},  # deepseek-chat, cache miss / hit
    "moonshot": {"input": 0.60, "cached": 0.15},  # kimi-k2
    "gemini": {"input": 0.30, "cached": 0.03},  # gemini-2.5-flash, implicit cache
    "bedrock_converse": {"input": 0.80, "cached": 0.20},  # amazon.nova-pro
    "local": {"input": 0.0, "cached": 0.0},  # the bundled engine: no bill
}
PREFILL_MS_PER_TOKEN = 0.37
MIN_GAIN_POINTS = 1.0  # below this a variant is "no gain"
ALL_BETTER_POINTS = 5.0  # advise all opt-ins when they beat the best single one by this much
DAY_S = 86400
TOTALS_FAMILY = ""  # a tenant's every request, evaluated or not (not a prefix family)


def _route_kind(fields: Mapping[str, int]) -> str:
    """The cache family most of a family's requests went to (openai on a tie or none)."""
    counts = {
        name.removeprefix("route:"): count
        for name, count in fields.items()
        if name.startswith("route:") and count
    }
    best = max(counts, key=lambda name: (counts[name], name == "openai"), default="openai")
    return best


def _share(fields: Mapping[str, int], variant: str) -> float | None:
    prompt = fields.get(f"prompt:{variant}", 0)
    return fields.get(f"cached:{variant}", 0) / prompt if prompt else None


def _cost(fields: Mapping[str, int], variant: str, price: Mapping[str, float]) -> float:
    prompt, cached = fields.get(f"prompt:{variant}", 0), fields.get(f"cached:{variant}", 0)
    return ((prompt - cached) * price["input"] + cached * price["cached"]) / 1e6


def _variant(
    fields: Mapping[str, int],
    variant: str,
    window_s: int,
    price: Mapping[str, float],
    scale: float,
) -> dict:
    sampled = fields.get("sampled", 0)
    share, observed = _share(fields, variant), _share(fields, OBSERVED)
    if not sampled or share is None or observed is None:
        return {
            "cached_share": None,
            "gain_points": None,
            "est_tokens_saved_per_day": None,
            "est_cost_saved_per_day_usd": None,
            "est_ttft_saved_ms": None,
        }
    uncached = fields[f"prompt:{OBSERVED}"] - fields.get(f"cached:{OBSERVED}", 0)
    uncached_v = fields[f"prompt:{variant}"] - fields.get(f"cached:{variant}", 0)
    saved_per_request = (uncached - uncached_v) / sampled
    cost_per_request = (_cost(fields, OBSERVED, price) - _cost(fields, variant, price)) / sampled
    per_day = fields.get("requests", sampled) * scale * DAY_S / window_s
    return {
        "cached_share": round(share, 4),
        "gain_points": round(100 * (share - observed), 1),
        "est_tokens_saved_per_day": round(saved_per_request * per_day),
        "est_cost_saved_per_day_usd": round(cost_per_request * per_day, 2),
        "est_ttft_saved_ms": round(saved_per_request * PREFILL_MS_PER_TOKEN, 1),
    }


def advice_text(variants: Mapping[str, dict]) -> str:
    """ "turn on X: +N% cached, ~$Y/day", or why nothing is advised."""
    singles = [(name, variants[name]) for name in OPT_INS if variants[name]["gain_points"]]
    best = max(singles, key=lambda item: item[1]["gain_points"], default=None)
    every = variants[ALL_OPT_INS]
    if every["gain_points"] is None:
        return "not enough sampled requests yet"
    best_gain = best[1]["gain_points"] if best else 0.0
    if every["gain_points"] >= MIN_GAIN_POINTS and every["gain_points"] >= best_gain + (
        ALL_BETTER_POINTS
    ):
        helping = [f"{ENV_PREFIX}{name}" for name, figures in singles if figures["gain_points"] > 0]
        which = f" ({', '.join(helping)} together)" if helping else ""
        return (
            f"turn on all opt-ins{which}: +{every['gain_points']:.0f}% cached, "
            f"~${every['est_cost_saved_per_day_usd']:.2f}/day"
        )
    if best is not None and best_gain >= MIN_GAIN_POINTS:
        name, figures = best
        return (
            f"turn on {ENV_PREFIX}{name}: +{figures['gain_points']:.0f}% cached, "
            f"~${figures['est_cost_saved_per_day_usd']:.2f}/day"
        )
    return "no opt-in would raise the cached share"


def _break_kinds(fields: Mapping[str, int]) -> dict[str, int]:
    breaks = {
        name.removeprefix("break:"): count
        for name, count in fields.items()
        if name.startswith("break:") and count
    }
    return dict(sorted(breaks.items(), key=lambda item: -item[1]))


def family_advice(
    family: str,
    fields: Mapping[str, int],
    window_s: int,
    prices: Mapping[str, Mapping[str, float]] = PRICES,
    scale: float = 1.0,
) -> dict:
    """One family's figures; ``scale`` is all requests over evaluated ones (sampling)."""
    kind = _route_kind(fields)
    price = prices.get(kind) or prices["openai"]
    variants = {name: _variant(fields, name, window_s, price, scale) for name in VARIANTS}
    observed = _share(fields, OBSERVED)
    return {
        "family": family,
        "route_rules": kind,
        "requests": fields.get("requests", 0),
        "sampled_requests": fields.get("sampled", 0),
        "prompt_tokens": fields.get("prompt", 0),
        "observed_cached_share": None if observed is None else round(observed, 4),
        "variants": variants,
        "break_kinds": _break_kinds(fields),
        "advice": advice_text(variants),
    }


def tenant_advice(
    tenant: str,
    per_family: Mapping[str, Mapping[str, int]],
    window_s: int,
    prices: Mapping[str, Mapping[str, float]] = PRICES,
) -> dict:
    """The endpoint's answer for one tenant: each family, busiest first, and a summary over
    all of them (the same figures computed on the families' summed counters)."""
    per_family = dict(per_family)
    totals = per_family.pop(TOTALS_FAMILY, {})
    evaluated = sum(fields.get("requests", 0) for fields in per_family.values())
    seen = totals.get("requests", evaluated)
    scale = max(seen / evaluated, 1.0) if evaluated else 1.0
    families = sorted(
        (
            family_advice(family, fields, window_s, prices, scale)
            for family, fields in per_family.items()
        ),
        key=lambda item: -item["requests"],
    )
    summed: dict[str, int] = {}
    for fields in per_family.values():
        for name, amount in fields.items():
            summed[name] = summed.get(name, 0) + amount
    summary = family_advice("*", summed, window_s, prices, scale)
    summary["requests_seen"] = seen
    # Breaks are counted for every request (not only evaluated ones) in the tenant's totals,
    # by the diagnostics that set the header and the Prometheus counter.
    summary["break_kinds"] = _break_kinds(totals)
    summary["prompt_tokens_seen"] = totals.get("prompt", summary["prompt_tokens"])
    del summary["family"], summary["route_rules"]
    for name, figures in summary["variants"].items():
        # Each family at its own route's prices, then added up.
        for key in ("est_tokens_saved_per_day", "est_cost_saved_per_day_usd"):
            known = [f["variants"][name][key] for f in families if f["variants"][name][key]]
            if figures[key] is not None:
                figures[key] = round(sum(known), 2) if known else 0
    summary["advice"] = advice_text(summary["variants"])
    summary["families"] = len(families)
    return {
        "tenant": tenant,
        "window_s": window_s,
        "summary": summary,
        "families": families,
        "estimates": {
            "prices_usd_per_mtok": prices,
            "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
            "note": (
                "Estimates: list prices, not a bill (Anthropic cache writes left out); TTFT "
                "from a per-token prefill figure; Anthropic hits approximated as the whole "
                "stable prefix above the model minimum (an upper bound)."
            ),
        },
    }
