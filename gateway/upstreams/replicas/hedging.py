"""When to hedge a first token, and how often one may.

A hedge sends the same request to a second replica when the first has produced no token within
`hedge_after_ms`; whichever answers first is streamed and the other is closed. It cuts the tail
that one slow replica (a long prefill ahead in its queue, a GC pause, a dying host) puts on
TTFT, at the price of extra upstream work, which `HedgeBudget` bounds so that a slow fleet is
not flooded with duplicates exactly when it is slowest.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 60.0
WINDOW_BUCKETS = 6
P95_SAMPLES = 256
P95_MIN_SAMPLES = 20
P95_REFRESH_EVERY = 16


class HedgeBudget:
    """Hedges allowed as a share of requests over the last minute (in 10 s buckets)."""

    def __init__(self, max_ratio: float) -> None:
        self.max_ratio = max_ratio
        self._span = WINDOW_S / WINDOW_BUCKETS
        self._buckets: deque[list[float]] = deque()  # [bucket start, requests, hedges]

    def _current(self, now: float) -> list[float]:
        start = now - now % self._span
        buckets = self._buckets
        if not buckets or buckets[-1][0] != start:
            buckets.append([start, 0.0, 0.0])
            while buckets[0][0] <= now - WINDOW_S:
                buckets.popleft()
        return buckets[-1]

    def request(self, now: float) -> None:
        self._current(now)[1] += 1

    def allow(self, now: float) -> bool:
        """Whether one more hedge keeps hedges within `max_ratio` of requests; counts it."""
        current = self._current(now)
        requests = sum(b[1] for b in self._buckets)
        hedges = sum(b[2] for b in self._buckets)
        if hedges + 1 > self.max_ratio * requests:
            return False
        current[2] += 1
        return True


class TtftTracker:
    """A route's recent upstream TTFTs, for `hedge_after_ms: "p95"`."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=P95_SAMPLES)
        self._p95: float | None = None
        self._since = 0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._since += 1
        if self._p95 is None or self._since >= P95_REFRESH_EVERY:
            self._refresh()

    def _refresh(self) -> None:
        self._since = 0
        if len(self._samples) < P95_MIN_SAMPLES:
            self._p95 = None
            return
        ordered = sorted(self._samples)
        self._p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    @property
    def p95(self) -> float | None:
        """None until enough samples came in: no hedging on a guess."""
        return self._p95
