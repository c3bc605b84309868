"""Is a replica fit to receive requests: passive ejection on failure, return on success or probe.

A replica that errors or times out is ejected for a while, and for longer each time it fails
again without a success in between (exponential backoff, capped), so that a dead replica costs
one failed request per backoff period instead of a share of all traffic. When the ejection
time has passed the replica is half-open: it is healthy again and gets traffic; one more
failure ejects it for twice as long, one success (or an active probe) resets it.

Failures that arrive while the replica is already ejected (requests that were in flight when
it broke) do not lengthen the ejection: a replica that dies with eight requests in flight has
failed once, not eight times.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_EXPONENT = 60  # 2**60 seconds is past any cap: keeps the float finite for any streak


@dataclass
class HealthPolicy:
    base_eject_s: float = 1.0
    max_eject_s: float = 60.0
    failures_to_eject: int = 1  # consecutive failures before the first ejection


class ReplicaHealth:
    """One replica's health. Pure: the caller passes `now` (monotonic seconds)."""

    def __init__(self, policy: HealthPolicy) -> None:
        if policy.failures_to_eject < 1:
            raise ValueError("failures_to_eject must be at least 1")
        self.policy = policy
        self.streak = 0  # consecutive failures counted since the last success
        self.ejected_until = 0.0
        self.last_failure: float | None = None
        self.ejections = 0

    def failed(self, now: float) -> None:
        """An error or a timeout. Ejects for base * 2**(streak - failures_to_eject), capped at
        max_eject_s (with the default failures_to_eject=1: base, 2*base, 4*base, ...)."""
        self.last_failure = now
        if now < self.ejected_until:
            return
        self.streak += 1
        excess = self.streak - self.policy.failures_to_eject
        if excess < 0:
            return
        backoff = self.policy.base_eject_s * 2.0 ** min(excess, _MAX_EXPONENT)
        self.ejected_until = now + min(backoff, self.policy.max_eject_s)
        self.ejections += 1

    def succeeded(self, now: float) -> None:
        """A request came back well: the streak is over and any ejection lifted."""
        self.streak = 0
        self.ejected_until = min(self.ejected_until, now)

    def probe_ok(self, now: float) -> None:
        """An active probe answered: healthy again, as after a success."""
        self.succeeded(now)

    def healthy(self, now: float) -> bool:
        return now >= self.ejected_until

    def state(self, now: float) -> str:
        return "healthy" if self.healthy(now) else "ejected"
