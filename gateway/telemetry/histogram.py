"""Fixed log-scale histogram buckets, shared by every store and every reader.

Each gateway process adds counts to the same numbered buckets, so histograms from
many processes and many minutes merge by plain addition (Redis `HINCRBY`), and a
percentile read from the merged counts is as good as one read from the raw
samples, up to the bucket width.

Bucket `i >= 1` holds values in `[MIN_S * GROWTH**(i-1), MIN_S * GROWTH**i)`;
bucket 0 holds everything below `MIN_S` (reported as 0). A percentile is reported
as the geometric midpoint of its bucket, so its relative error is at most
`sqrt(GROWTH) - 1` (about 2% for GROWTH 1.04), well inside the 5% the issue asks for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

GROWTH = 1.04
MIN_S = 1e-5  # 10 µs: the gateway's own share can be this small
MAX_INDEX = 520  # MIN_S * GROWTH**520 is about 7 hours; longer values share the last bucket

_LOG_GROWTH = math.log(GROWTH)


def bucket_index(value_s: float) -> int:
    """The bucket a duration in seconds falls into (negative and NaN count as 0)."""
    if not value_s > MIN_S:  # also catches NaN
        return 0
    index = int(math.log(value_s / MIN_S) / _LOG_GROWTH) + 1
    return index if index < MAX_INDEX else MAX_INDEX


def bucket_bounds(index: int) -> tuple[float, float]:
    """The `[low, high)` range of a bucket in seconds."""
    if index <= 0:
        return 0.0, MIN_S
    return MIN_S * GROWTH ** (index - 1), MIN_S * GROWTH**index


def bucket_value(index: int) -> float:
    """The value a bucket stands for: its geometric midpoint (0 for the underflow bucket)."""
    if index <= 0:
        return 0.0
    return MIN_S * GROWTH ** (index - 0.5)


def percentiles(counts: Mapping[int, int], quantiles: Iterable[float]) -> list[float | None]:
    """Nearest-rank percentiles (in seconds) of a bucket histogram; None where it is empty.

    The q-quantile is the value of the sample of rank `ceil(q * n)` in sorted order,
    which here is the midpoint of the bucket where the running count reaches that rank.
    """
    wanted = list(quantiles)
    total = sum(c for c in counts.values() if c > 0)
    if total == 0:
        return [None] * len(wanted)
    ranks = [max(1, math.ceil(q * total)) for q in wanted]
    results: list[float | None] = [None] * len(wanted)
    order = sorted(range(len(wanted)), key=lambda i: ranks[i])
    running = 0
    cursor = 0
    for index in sorted(i for i, c in counts.items() if c > 0):
        running += counts[index]
        while cursor < len(order) and ranks[order[cursor]] <= running:
            results[order[cursor]] = bucket_value(index)
            cursor += 1
        if cursor == len(order):
            break
    return results


def share_at_or_below(counts: Mapping[int, int], threshold_s: float) -> float | None:
    """The share of samples at or below a threshold; None when there are no samples.

    Buckets entirely below the threshold count fully. The one bucket that straddles
    it counts in proportion to how far into it (on the log scale) the threshold
    lies, which assumes samples spread evenly inside a bucket; the error is bounded
    by that single bucket's share of the samples.
    """
    total = sum(c for c in counts.values() if c > 0)
    if total == 0:
        return None
    within = 0.0
    for index, count in counts.items():
        if count <= 0:
            continue
        low, high = bucket_bounds(index)
        if high <= threshold_s:
            within += count
        elif low < threshold_s:
            if index == 0:
                within += count * threshold_s / high
            else:
                within += count * math.log(threshold_s / low) / math.log(high / low)
    return within / total


def store_bounds(low_s: float, high_s: float, every: int = 1) -> tuple[float, ...]:
    """Every `every`-th boundary of the buckets above, from the last at or below `low_s` to the
    first at or above `high_s`, rounded to 4 significant digits (a 0.01% shift).

    Prometheus buckets on these boundaries (`every=1`) hold the same samples as the store's
    buckets, so `histogram_quantile` and the JSON figures pick the same bucket for a quantile
    (both find the first bucket whose running count reaches `q * n`) and differ by at most the
    gap between the bucket's midpoint and an edge: `sqrt(GROWTH) - 1`, about 2%.
    """
    if not 0 < low_s < high_s or every < 1:
        raise ValueError("need 0 < low_s < high_s and every >= 1")
    first = max(0, bucket_index(low_s) - 1)
    last = bucket_index(high_s)
    indexes = list(range(first, last + 1, every))
    if indexes[-1] < last:
        indexes.append(indexes[-1] + every)
    return tuple(float(f"{MIN_S * GROWTH**i:.4g}") for i in indexes)
