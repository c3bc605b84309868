import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.telemetry.histogram import (
    GROWTH,
    MIN_S,
    bucket_bounds,
    bucket_index,
    percentiles,
    share_at_or_below,
)


def _histogram(samples) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in samples:
        index = bucket_index(float(value))
        counts[index] = counts.get(index, 0) + 1
    return counts


def _nearest_rank(samples, q: float) -> float:
    ordered = np.sort(samples)
    return float(ordered[max(1, math.ceil(q * len(ordered))) - 1])


@pytest.mark.parametrize("mu,sigma", [(-1.2, 0.5), (-2.5, 1.2), (0.5, 0.3), (-7.0, 0.8)])
def test_percentiles_within_five_percent_of_exact_lognormal(mu: float, sigma: float) -> None:
    samples = np.random.default_rng(7).lognormal(mu, sigma, 20_000)
    counts = _histogram(samples)
    estimates = percentiles(counts, [0.5, 0.9, 0.99])
    for q, estimate in zip([0.5, 0.9, 0.99], estimates, strict=False):
        exact = float(np.quantile(samples, q))  # numpy's interpolated percentile
        assert abs(estimate - exact) / exact < 0.05, (q, estimate, exact)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=2e-5, max_value=3000.0), min_size=1, max_size=300),
    st.sampled_from([0.5, 0.9, 0.99, 0.01, 1.0]),
)
def test_percentile_error_bounded_by_half_a_bucket(samples: list[float], q: float) -> None:
    (estimate,) = percentiles(_histogram(samples), [q])
    exact = _nearest_rank(np.array(samples), q)
    assert abs(estimate - exact) / exact <= math.sqrt(GROWTH) - 1 + 1e-9


def test_bucket_bounds_contain_their_values() -> None:
    for value in [MIN_S * 1.0001, 0.001, 0.05, 0.2999, 1.0, 17.3, 3600.0]:
        low, high = bucket_bounds(bucket_index(value))
        assert low <= value < high
    assert bucket_index(0.0) == 0 and bucket_index(-1.0) == 0 and bucket_index(float("nan")) == 0


def test_empty_histogram_has_no_percentiles() -> None:
    assert percentiles({}, [0.5, 0.99]) == [None, None]
    assert share_at_or_below({}, 1.0) is None


def test_share_at_or_below_matches_exact_fraction() -> None:
    samples = np.random.default_rng(3).lognormal(-1.0, 0.7, 50_000)
    counts = _histogram(samples)
    for threshold in [0.1, 0.25, 0.5, 1.0, 2.0]:
        exact = float(np.mean(samples <= threshold))
        assert abs(share_at_or_below(counts, threshold) - exact) < 0.005, threshold


def test_share_counts_whole_buckets_below_threshold() -> None:
    counts = {bucket_index(0.1): 3, bucket_index(5.0): 1}
    assert share_at_or_below(counts, 1.0) == pytest.approx(0.75)
    assert share_at_or_below(counts, 0.001) == 0.0
    assert share_at_or_below(counts, 100.0) == 1.0
