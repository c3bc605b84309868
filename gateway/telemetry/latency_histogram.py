"""A Prometheus histogram of durations, cheap to observe however many buckets it has.

prometheus_client's `Histogram` finds a bucket by a linear scan under a lock and renders every
line through its generic formatter; with the ~200 buckets the TTFT series needs (see
`prometheus.py`) both would cost the request path and `/metrics` far more than before. Here an
observation is one C-level bisection and two additions, and each child renders its own lines
from label text it escaped once, when it was created.

Only the event loop observes. The exposition may run in a worker thread: it copies each
child's counts in one step, so `_count` always equals the `+Inf` bucket; `_sum` may be one
observation ahead or behind, as with prometheus_client's own histogram.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.utils import floatToGoString


def escape_label_value(value: str) -> str:
    """A label value as the text exposition format quotes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class LatencyChild:
    """One label combination: counts per bucket (the last one is `+Inf`) and the sum, and the
    label text of its lines, escaped and sorted by name once, as prometheus_client writes it."""

    __slots__ = ("bounds", "bucket_head", "bucket_tail", "counts", "labels_text", "sum")

    def __init__(self, bounds: tuple[float, ...], labels: dict[str, str]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        pairs = [f'{k}="{escape_label_value(v)}"' for k, v in sorted(labels.items())]
        self.labels_text = ",".join(pairs)
        below = [p for p, k in zip(pairs, sorted(labels), strict=True) if k < "le"]
        above = [p for p, k in zip(pairs, sorted(labels), strict=True) if k > "le"]
        self.bucket_head = "".join(p + "," for p in below) + 'le="'
        self.bucket_tail = '"' + "".join("," + p for p in above) + "} "

    def observe(self, value_s: float) -> None:
        """Count one duration in seconds: `le` semantics, a value on a bound counts in it."""
        self.counts[bisect_left(self.bounds, value_s)] += 1
        self.sum += value_s


class LatencyHistogram:
    """A histogram family with fixed label names; children are made by `labels` on first use
    and exposed once they hold an observation."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], bounds: Sequence[float]
    ) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        if "le" in labelnames:
            raise ValueError("'le' is the bucket label")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in bounds)
        self._les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        self._children: dict[tuple[str, ...], LatencyChild] = {}

    def labels(self, *values: str) -> LatencyChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}")
            labels = dict(zip(self.labelnames, values, strict=True))
            child = self._children[values] = LatencyChild(self.bounds, labels)
        return child

    @property
    def series_per_child(self) -> int:
        """Lines one exposed child costs: its buckets, `+Inf`, `_count` and `_sum`."""
        return len(self.bounds) + 3

    def render(self) -> str:
        """The family in the Prometheus text format (0.0.4), line for line as prometheus_client
        renders a histogram without `_created`."""
        name = self.name
        doc = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {name} {doc}\n# TYPE {name} histogram\n"]
        for child in self._children.copy().values():
            counts = child.counts.copy()
            if not any(counts):
                continue  # never observed: not exposed
            head = f"{name}_bucket{{{child.bucket_head}"
            tail = child.bucket_tail
            running = 0
            for count, le in zip(counts, self._les, strict=True):
                running += count
                lines.append(f"{head}{le}{tail}{running}.0\n")
            labels = child.labels_text
            lines.append(f"{name}_count{{{labels}}} {running}.0\n")
            lines.append(f"{name}_sum{{{labels}}} {floatToGoString(child.sum)}\n")
        return "".join(lines)
