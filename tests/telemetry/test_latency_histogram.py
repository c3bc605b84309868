"""The hand-rolled histogram renders exactly what prometheus_client's own would, so scrapers,
parsers and tests that read the text see no difference, only the cost is lower."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.telemetry.latency_histogram import LatencyHistogram
from gateway.telemetry.prometheus import TTFT_BUCKETS_S

LABELS = ("tenant", "family", "route")  # unsorted on purpose: the text sorts them, `le` inside


def test_renders_byte_for_byte_like_prometheus_client() -> None:
    registry = CollectorRegistry()
    doc = 'Doc with "quotes", a \\ and a\nnewline.'
    reference = Histogram("x_seconds", doc, LABELS, buckets=TTFT_BUCKETS_S, registry=registry)
    ours = LatencyHistogram("x_seconds", doc, LABELS, TTFT_BUCKETS_S)
    rng = random.Random(5)
    names = [("acme", "files", "r1"), ('a"b\\c\nd', "batches", "r2"), ("beta", "files", "r1")]
    values = [rng.lognormvariate(-1, 2) for _ in range(3000)] + list(TTFT_BUCKETS_S)  # on bounds
    for i, value in enumerate(values):
        labels = names[i % len(names)]
        reference.labels(*labels).observe(value)
        ours.labels(*labels).observe(value)
    assert ours.render() == generate_latest(registry).decode()


def test_a_child_is_exposed_once_observed() -> None:
    histogram = LatencyHistogram("y_seconds", "doc", ("tenant",), (0.1, 1.0))
    child = histogram.labels("acme")
    assert "acme" not in histogram.render()
    child.observe(0.5)
    lines = histogram.render().splitlines()
    assert 'y_seconds_bucket{le="0.1",tenant="acme"} 0.0' in lines
    assert 'y_seconds_bucket{le="1.0",tenant="acme"} 1.0' in lines
    assert 'y_seconds_count{tenant="acme"} 1.0' in lines
    assert len(lines) == 2 + histogram.series_per_child


def test_rejects_bad_layouts_and_labels() -> None:
    with pytest.raises(ValueError):
        LatencyHistogram("z", "doc", ("tenant",), (1.0, 0.5))
    with pytest.raises(ValueError):
        LatencyHistogram("z", "doc", ("le",), (1.0,))
    with pytest.raises(ValueError):
        LatencyHistogram("z", "doc", ("tenant",), (1.0,)).labels("a", "b")
