"""What an operator's PromQL query reads from `/metrics`, computed the way Prometheus does.

`histogram_quantile(q, sum by (le) (firsttoken_ttft_seconds_bucket{tenant=..., route=...}))`:
the buckets of every series that matches are summed per `le`, then the quantile is
interpolated linearly inside the bucket where the running count reaches `q * count`
(promql/quantile.go, `bucketQuantile`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(exposition: str) -> list[Sample]:
    """Every sample of a text exposition (parse once: the parser is slow)."""
    return [s for family in text_string_to_metric_families(exposition) for s in family.samples]


def summed_buckets(parsed: Iterable[Sample], metric: str, **match: str) -> dict[float, float]:
    """`sum by (le) (<metric>_bucket{match})`: cumulative count per upper bound."""
    buckets: dict[float, float] = {}
    for sample in parsed:
        if sample.name != metric + "_bucket":
            continue
        if any(sample.labels.get(k) != v for k, v in match.items()):
            continue
        le = float(sample.labels["le"])
        buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus's `histogram_quantile` over cumulative buckets keyed by upper bound."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return math.nan
    counts = [buckets[b] for b in bounds]
    for i in range(1, len(counts)):  # Prometheus repairs non-monotonic buckets the same way
        counts[i] = max(counts[i], counts[i - 1])
    observations = counts[-1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    return start + (bounds[b] - start) * (rank - below) / (counts[b] - below)
