"""TTFT over time: the figures of each step of a window, for charts.

A series reads the same per-minute buckets as the JSON report (`report.py`), in one
`Store.read_steps` call per tenant, and sums the minutes of each step. Redis buckets are
shared by every gateway process, so a series over Redis is already the merge of all of
them; over the in-process store it is this process's requests only.

Steps are aligned to `step_s` since the Unix epoch, and the window is rounded out to whole
steps, as the report rounds it out to whole minutes: the points are every step that overlaps
`[now - window, now]`, oldest first, the last one still filling. With `step_s` 60 the points
cover exactly the minutes of the report over the same window, so their counts sum to its count.

Per point:
- quantiles from the bucket histograms, by the report's own estimator (`report.series_ms`);
- `gateway_share`: mean gateway time over mean TTFT, each from its own sums and counts (a
  ratio of sums, not of medians): the share of the average first token the gateway spent.
  Gateway time exists only for streams with an upstream first token, TTFT for every stream
  with a first token, hence the per-series counts;
- `cached_share`: cached prompt tokens over prompt tokens;
- `slo_attainment`: the share of streamed first tokens within the tenant's SLO target, from
  the TTFT histogram as the report computes it (`histogram.share_at_or_below`); for all
  tenants (`*`), each tenant's requests against that tenant's own target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .aggregate import Fields, checked_api, histogram_counts, merge_fields
from .histogram import share_at_or_below
from .report import FULL_QUANTILES, SloConfig, series_ms
from .store import StepKey, Store

MIN_WINDOW_S = 60
MAX_WINDOW_S = 31 * 86400
MIN_STEP_S = 60
MAX_STEP_S = 86400
MAX_POINTS = 1500


def max_points(window_s: int, step_s: int) -> int:
    """The most points a window can span, whatever `now` is: a window that is not aligned
    touches one step more than it covers. Callers bound this, not the count of the moment,
    so the same query is accepted or refused at any time."""
    return math.ceil(window_s / step_s) + 1


def series_problem(window_s: int, step_s: int) -> tuple[str, str] | None:
    """(parameter, message) of what is wrong with a window and step; None when they are fine."""
    if not MIN_WINDOW_S <= window_s <= MAX_WINDOW_S:
        return "window", (
            f"'window' must be an integer number of seconds in {MIN_WINDOW_S}..{MAX_WINDOW_S}."
        )
    if not MIN_STEP_S <= step_s <= MAX_STEP_S or step_s % 60:
        return "step", (f"'step' must be a multiple of 60 seconds in {MIN_STEP_S}..{MAX_STEP_S}.")
    points = max_points(window_s, step_s)
    if points > MAX_POINTS:
        return "step", (
            f"window={window_s} at step={step_s} spans up to {points} points; at most "
            f"{MAX_POINTS} points per answer: raise 'step' or shorten 'window'."
        )
    return None


def step_starts(window_s: int, step_s: int, now: float) -> range:
    """The start (Unix seconds) of every step overlapping `[now - window, now]`."""
    first = int((now - window_s) // step_s) * step_s
    last = int(now // step_s) * step_s
    return range(first, last + 1, step_s)


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 6) if denominator > 0 else None


def _gateway_share(fields: Fields) -> float | None:
    ttft_n = sum(histogram_counts(fields, "t").values())
    gateway_n = sum(histogram_counts(fields, "g").values())
    if not ttft_n or not gateway_n:
        return None
    mean_ttft = fields.get("t_sum", 0.0) / ttft_n
    return _ratio(fields.get("g_sum", 0.0) / gateway_n, mean_ttft)


def point_figures(t: int, fields: Fields, met: float, streams: int) -> dict[str, Any]:
    """One point of the series from a step's merged counters; `met` of the `streams` TTFT
    samples were within their tenant's SLO target."""
    return {
        "t": t,
        "count": int(fields.get("n", 0)),
        "errors": int(fields.get("err", 0)),
        "hedges": int(fields.get("hedged", 0)),
        "ttft_ms": series_ms(fields, "t", FULL_QUANTILES, mean=False),
        "upstream_ttft_ms": series_ms(fields, "u", FULL_QUANTILES, mean=False),
        "gateway_ms": series_ms(fields, "g", FULL_QUANTILES, mean=False),
        "gateway_share": _gateway_share(fields),
        "cached_share": _ratio(fields.get("cached", 0), fields.get("prompt", 0)),
        "prompt_tokens_saved": int(fields.get("saved", 0)),
        "slo_attainment": _ratio(met, streams),
    }


class _Steps:
    """Counters per step summed over tenants, with each tenant's SLO hits counted against its
    own target, and requests per route for `routes`."""

    def __init__(self) -> None:
        self.fields: dict[int, Fields] = {}
        self.met: dict[int, float] = {}
        self.streams: dict[int, int] = {}
        self.route_counts: dict[str, int] = {}

    def add_tenant(
        self,
        split: Mapping[StepKey, Fields],
        target_ms: float,
        route: str | None,
        api: str | None,
    ) -> None:
        mine: dict[int, Fields] = {}
        for (route_name, api_name, minute), fields in split.items():
            if api is not None and api_name != api:
                continue
            count = int(fields.get("n", 0))
            if count:
                self.route_counts[route_name] = self.route_counts.get(route_name, 0) + count
            if route is None or route_name == route:
                merge_fields(mine.setdefault(minute * 60, {}), fields)
        for t, fields in mine.items():
            merge_fields(self.fields.setdefault(t, {}), fields)
            ttft = histogram_counts(fields, "t")
            share = share_at_or_below(ttft, target_ms / 1000.0)
            if share is not None:
                samples = sum(c for c in ttft.values() if c > 0)
                self.met[t] = self.met.get(t, 0.0) + share * samples
                self.streams[t] = self.streams.get(t, 0) + samples

    def routes(self) -> list[str]:
        """Routes with requests in the window, busiest first (then by name)."""
        return sorted(self.route_counts, key=lambda r: (-self.route_counts[r], r))


async def _summed_series(
    store: Store,
    tenants: list[str],
    window_s: int,
    step_s: int,
    slo: SloConfig,
    now: float,
    route: str | None = None,
    api: str | None = None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """(`routes`, `points`) of the tenants' requests summed: one `read_steps` per tenant for
    the whole window. Raises ValueError for a window, step or `api` out of bounds."""
    problem = series_problem(window_s, step_s)
    if problem is not None:
        raise ValueError(problem[1])
    if api is not None:
        checked_api(api)
    starts = step_starts(window_s, step_s, now)
    first_minute, last_minute = starts[0] // 60, int(now // 60)
    steps = _Steps()
    for tenant in tenants:
        split = await store.read_steps(tenant, first_minute, last_minute, step_s // 60)
        steps.add_tenant(split, slo.target_ms(tenant), route, api)
    points = [
        point_figures(t, steps.fields.get(t, {}), steps.met.get(t, 0.0), steps.streams.get(t, 0))
        for t in starts
    ]
    return steps.routes(), points


async def tenant_series(
    store: Store,
    tenant: str,
    window_s: int,
    step_s: int,
    slo: SloConfig,
    now: float,
    route: str | None = None,
    api: str | None = None,
    tenants: list[str] | None = None,
) -> dict[str, Any]:
    """The series answer for `tenant`, or with `tenants` (for `*`, every known tenant) their
    requests summed, `slo_ms` then the default target (each tenant is still held to its own)."""
    readers = [tenant] if tenants is None else tenants
    routes, points = await _summed_series(store, readers, window_s, step_s, slo, now, route, api)
    return {
        "tenant": tenant,
        "window_s": window_s,
        "step_s": step_s,
        "route": route,
        "api": api,
        "slo_ms": slo.default_ms if tenants is not None else slo.target_ms(tenant),
        "routes": routes,
        "points": points,
    }
