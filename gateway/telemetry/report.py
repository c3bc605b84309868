"""Turning merged counters into the figures operators read: percentiles, ratios, SLOs.

Every reader (the JSON endpoint, the command line, tests) goes through here, over
counters from any store, so they all print the same numbers.

SLO attainment is the share of TTFT samples at or below the tenant's target,
read from the histogram (the one bucket straddling the target is interpolated on
the log scale, see `histogram.share_at_or_below`). Only requests that produced a
first token have a TTFT, so failures count as errors, not as SLO misses.
`budget_remaining = 1 - (1 - attainment) / (1 - objective)`: 1 when nothing
missed, 0 when misses used exactly the budget the objective allows, negative when
they used more (-1 means twice the budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .aggregate import Fields, checked_api, histogram_counts, minute_of
from .event import APIS, STATUSES
from .histogram import percentiles, share_at_or_below
from .store import Store, per_api, per_route

if TYPE_CHECKING:
    from gateway.config.settings import Settings


@dataclass(frozen=True, slots=True)
class SloConfig:
    default_ms: float = 1000.0
    tenants: Mapping[str, float] = field(default_factory=dict)
    objective: float = 0.99

    def __post_init__(self) -> None:
        if not 0 < self.objective < 1:
            raise ValueError(
                f"SLO objective must be between 0 and 1 (exclusive), got {self.objective}"
            )
        if self.default_ms <= 0 or any(ms <= 0 for ms in self.tenants.values()):
            raise ValueError("SLO targets must be positive milliseconds")

    @classmethod
    def from_settings(cls, settings: Settings) -> SloConfig:
        """The targets the gateway serves, from `FIRSTTOKEN_TTFT_SLO_*`."""
        return cls(
            default_ms=settings.ttft_slo_ms,
            tenants=settings.ttft_slo_tenants,
            objective=settings.ttft_slo_objective,
        )

    def target_ms(self, tenant: str) -> float:
        return float(self.tenants.get(tenant, self.default_ms))


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000.0, 3)


def series_ms(
    fields: Fields, series: str, quantiles: Mapping[str, float], mean: bool
) -> dict[str, Any]:
    """Named quantiles (and the mean) of one histogram series (`t`, `u`, `g`, `c`), in ms."""
    counts = histogram_counts(fields, series)
    values = percentiles(counts, quantiles.values())
    figures: dict[str, Any] = {name: _ms(v) for name, v in zip(quantiles, values, strict=False)}
    if mean:
        n = sum(counts.values())
        figures["mean"] = _ms(fields.get(f"{series}_sum", 0.0) / n) if n else None
    return figures


FULL_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
_SHORT = {"p50": 0.5, "p99": 0.99}


def slo_figures(fields: Fields, target_ms: float, objective: float) -> dict[str, Any]:
    attainment = share_at_or_below(histogram_counts(fields, "t"), target_ms / 1000.0)
    budget = None if attainment is None else 1.0 - (1.0 - attainment) / (1.0 - objective)
    return {
        "target_ms": target_ms,
        "objective": objective,
        "attainment": None if attainment is None else round(attainment, 6),
        "budget_remaining": None if budget is None else round(budget, 6),
    }


def route_figures(route: str, fields: Fields, slo: SloConfig, tenant: str) -> dict[str, Any]:
    """The per-route dict of the metrics JSON, from one route's merged counters."""
    return {"route": route, **figures(fields, slo, tenant)}


def api_figures(api: str, fields: Fields, slo: SloConfig, tenant: str) -> dict[str, Any]:
    """The per-API dict of the metrics JSON (`by_api`): the same figures as a route's."""
    return {"api": api, **figures(fields, slo, tenant)}


def figures(fields: Fields, slo: SloConfig, tenant: str) -> dict[str, Any]:
    """Every figure of one set of merged counters (a route's, an API's)."""
    prompt = int(fields.get("prompt", 0))
    cached = int(fields.get("cached", 0))
    count = int(fields.get("n", 0))
    itl_n = int(fields.get("itl_n", 0))
    return {
        "count": count,
        "stream_count": int(fields.get("stream", 0)),
        "ttft_ms": series_ms(fields, "t", FULL_QUANTILES, mean=True),
        "upstream_ttft_ms": series_ms(fields, "u", FULL_QUANTILES, mean=True),
        "gateway_ms": series_ms(fields, "g", _SHORT, mean=False),
        "complete_ms": series_ms(fields, "c", FULL_QUANTILES, mean=True),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "cache_hit_ratio": round(cached / prompt, 6) if prompt else None,
        "prompt_tokens_saved": int(fields.get("saved", 0)),
        "output_tokens": int(fields.get("out", 0)),
        "mean_itl_ms": _ms(fields.get("itl_sum", 0.0) / itl_n) if itl_n else None,
        "mean_total_ms": _ms(fields.get("total_sum", 0.0) / count) if count else None,
        "errors": int(fields.get("err", 0)),
        "statuses": {s: int(fields[f"s:{s}"]) for s in (*STATUSES, "other") if f"s:{s}" in fields},
        "fallbacks": int(fields.get("fb", 0)),
        "slo": slo_figures(fields, slo.target_ms(tenant), slo.objective),
    }


def window_minutes(window_s: int, now: float) -> tuple[int, int]:
    """The minute buckets a window covers: every minute that overlaps `[now - window, now]`."""
    return minute_of(now - window_s), minute_of(now)


async def tenant_report(
    store: Store, tenant: str, window_s: int, slo: SloConfig, now: float, api: str | None = None
) -> dict:
    """One tenant's figures per route and per client API (`by_api`, in `APIS` order); with
    `api`, only that API's requests, in both."""
    if api is not None:
        checked_api(api)
    first, last = window_minutes(window_s, now)
    split = await store.read_split(tenant, first, last)
    if api is not None:
        split = {key: fields for key, fields in split.items() if key[1] == api}
    routes = per_route(split)
    apis = per_api(split)
    return {
        "tenant": tenant,
        "window_s": window_s,
        "api": api,
        "routes": [route_figures(r, routes[r], slo, tenant) for r in sorted(routes)],
        "by_api": [api_figures(a, apis[a], slo, tenant) for a in APIS if a in apis],
    }
