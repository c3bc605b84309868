"""What a request would wait for its first token on each replica, in milliseconds, from what the
gateway has seen of each replica's answers.

A prefix-caching server's time to first token is, once the request has a slot,

    ttft ≈ fixed(r) + prefill(r) * uncached tokens

(`fixed`: scheduling, the network, the first decode step; `prefill`: the per-token cost of the
part of the prompt not in its cache), plus the wait for a slot when the server is full. The
gateway sees every TTFT and knows what it expected to be uncached, so it fits both:

- the prefill rate, pooled over the route's replicas (one model on one kind of hardware), as a
  least-squares slope of TTFT against uncached tokens, with old samples decaying;
- each replica's `fixed` part, as the median of its last `FIXED_SAMPLES` residuals (TTFT minus
  the prefill of the uncached part), from requests sent while it had a free slot: a median,
  so that a few prompts it had evicted do not read as a slow replica, and a short one, so
  that a replica that turns 300 ms slower is seen within a handful of requests;
- how long a request holds a slot (`service_ms`, a moving average of send to end, from
  requests that found a slot free), which turns the requests ahead of a new one into a wait.

Tokens are the gateway's estimate (characters / `CHARS_PER_TOKEN`, no tokenizer on the path):
the slope is fitted in the same unit, so the estimate's bias cancels.
"""

from __future__ import annotations

import statistics
from collections import deque

CHARS_PER_TOKEN = 4
FIXED_SAMPLES = 9
SLOPE_HALF_LIFE = 256  # samples
SERVICE_ALPHA = 0.1
MIN_SPREAD_TOKENS = 64.0  # below this spread of uncached tokens a slope is noise
SESSION_ALPHA = 0.02


class ReplicaLatency:
    """One replica's fixed part and slot time, `None` until it has been seen."""

    def __init__(self) -> None:
        self._residuals: deque[float] = deque(maxlen=FIXED_SAMPLES)
        self.service_ms: float | None = None
        self.samples = 0  # residuals seen, ever: what a cached figure was computed from
        self._fixed: float | None = None

    def observe_fixed(self, residual_ms: float) -> None:
        self._residuals.append(residual_ms)
        self.samples += 1
        self._fixed = None

    def observe_service(self, ms: float) -> None:
        if self.service_ms is None:
            self.service_ms = ms
        else:
            self.service_ms += SERVICE_ALPHA * (ms - self.service_ms)

    @property
    def fixed_ms(self) -> float | None:
        if self._fixed is None and self._residuals:
            self._fixed = statistics.median(self._residuals)
        return self._fixed

    @property
    def residuals(self) -> tuple[float, ...]:
        return tuple(self._residuals)


class FleetLatency:
    """The route's pooled prefill rate and how many turns its conversations last."""

    def __init__(self, prior_prefill_ms_per_token: float) -> None:
        self.prior_prefill = prior_prefill_ms_per_token
        self._decay = 0.5 ** (1.0 / SLOPE_HALF_LIFE)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._first_share = 1.0  # share of requests that open a conversation
        # every choice weighs the excesses, which change only with a residual: the last ones,
        # under the fleet's replicas and how many residuals each had seen
        self._excesses_of: tuple[tuple[ReplicaLatency, int], ...] = ()
        self._excesses: list[float] = []

    def observe_ttft(self, ttft_ms: float, uncached_tokens: float) -> None:
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + uncached_tokens
        self._y = self._y * d + ttft_ms
        self._xx = self._xx * d + uncached_tokens * uncached_tokens
        self._xy = self._xy * d + uncached_tokens * ttft_ms

    def observe_turn(self, first_turn: bool) -> None:
        self._first_share += SESSION_ALPHA * (float(first_turn) - self._first_share)

    @property
    def prefill_ms_per_token(self) -> float:
        """The fitted slope; the prior until uncached sizes have varied enough to fit one."""
        if self._w < 2:
            return self.prior_prefill
        mean_x = self._x / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_SPREAD_TOKENS * MIN_SPREAD_TOKENS:
            return self.prior_prefill
        cov = self._xy / self._w - mean_x * (self._y / self._w)
        return max(0.0, cov / var_x)

    @property
    def turns_per_session(self) -> float:
        """Requests per conversation: 1 / the share of requests that are a first turn."""
        return 1.0 / max(self._first_share, 1.0 / 64)

    def excess_ms(self, replica: ReplicaLatency, fleet: list[ReplicaLatency]) -> float:
        """How much slower `replica`'s fixed part is than the fastest of `fleet`'s, counting
        only what stands out of the noise: a difference under three times the residuals'
        median absolute deviation (each from its replica's median, pooled over the fleet)
        is 0. A replica not yet seen is assumed like the others (0)."""
        own = replica.fixed_ms
        if own is None:
            return 0.0
        return max(0.0, own - _slowest_unremarkable(fleet, [r.fixed_ms for r in fleet]))

    def excesses(self, fleet: list[ReplicaLatency]) -> list[float]:
        """`excess_ms` of each of `fleet`'s replicas, in one pass over the fleet (a choice
        weighs them all), computed again only after a residual was observed."""
        seen = tuple((r, r.samples) for r in fleet)
        if seen != self._excesses_of:
            self._excesses = self._compute_excesses(fleet)
            self._excesses_of = seen
        return list(self._excesses)

    @staticmethod
    def _compute_excesses(fleet: list[ReplicaLatency]) -> list[float]:
        fixed = [r.fixed_ms for r in fleet]
        if all(f is None for f in fixed):
            return [0.0] * len(fleet)
        floor = _slowest_unremarkable(fleet, fixed)
        return [0.0 if f is None else max(0.0, f - floor) for f in fixed]


def _slowest_unremarkable(fleet: list[ReplicaLatency], fixed: list[float | None]) -> float:
    """The fixed part (`fixed`: each of `fleet`'s, None where not seen) above which a replica
    stands out as slower: the fastest replica's plus three times the pooled deviation. Some
    replica of `fleet` has been seen."""
    deviations = [
        abs(x - median)
        for r, median in zip(fleet, fixed, strict=True)
        if median is not None
        for x in r.residuals
    ]
    return min(f for f in fixed if f is not None) + 3.0 * statistics.median(deviations)
