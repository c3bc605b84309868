"""Is a replica fit to receive requests: outlier detection on the replica's own failures.

A replica is ejected for what it does to everyone, never for what one request does to it, in
the way Envoy's outlier detection works:

- **Consecutive gateway failures** (`failed(now)`, kind "gateway": a 502, 503 or 504, a
  timeout, a refused or broken connection): `failures_to_eject` in a row with no success in
  between eject the replica. These say the server itself is down or stuck, whoever asked.
- **Failure rate** (kind "server": any other 5xx, which a request's own body can cause, such
  as a validation error a server reports as a 500): never ejects on its own streak. Over a
  window of `rate_window_s`, a replica whose failures (gateway ones, plus server ones where at
  least two tenants got them) make up `rate_threshold` of at least `rate_min_requests`
  requests is ejected. One tenant whose bodies make a server answer 500 sees its own errors
  and nobody else's replica goes away.
- 4xx and 429 are the request's own (or the server's back-pressure, which the queue signal
  and the proxy's retry handle): they never count against the replica.

An ejection lasts base * 2**(ejections in a row - 1), capped at max_eject_s; a success (or an
active probe) ends the run. Failures that arrive while the replica is already ejected (requests
in flight when it broke) do not lengthen it: a replica that dies with eight requests in flight
failed once. At most `max_ejected_share` of a pool is ejected at a time (at least one replica
may always be), shared through one `EjectionLimit`: a fault that looks like every replica's is
more likely the traffic's, and a fleet with half its replicas left still answers.

A replica that never answered (no success, no probe, no `/metrics` read, no error answer with
a body) is "starting": it takes requests (a fleet just started has nothing else), but
`/readyz` does not call it healthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_EXPONENT = 60  # 2**60 seconds is past any cap: keeps the float finite for any streak
MAX_TENANTS_TRACKED = 64  # distinct tenants counted per window; more counts as "several"
GATEWAY_STATUSES = frozenset({502, 503, 504})


@dataclass
class HealthPolicy:
    base_eject_s: float = 1.0
    max_eject_s: float = 60.0
    failures_to_eject: int = 1  # consecutive gateway failures before an ejection
    rate_window_s: float = 10.0
    rate_min_requests: int = 20
    rate_threshold: float = 0.5
    max_ejected_share: float = 0.5


def failure_kind(status: int) -> str | None:
    """How an answer's status counts against the replica that gave it: "gateway" (the server
    is down or stuck), "server" (a 5xx a request may have caused), None (the request's own)."""
    if status in GATEWAY_STATUSES:
        return "gateway"
    if status >= 500:
        return "server"
    return None


class EjectionLimit:
    """How many replicas of one pool may be ejected at once: `max_ejected_share` of them,
    rounded down, and at least one."""

    def __init__(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError("max_ejected_share must be between 0 and 1")
        self.share = share
        self.members: list[ReplicaHealth] = []

    def allows(self, now: float) -> bool:
        ejected = sum(1 for h in self.members if not h.healthy(now))
        return ejected < max(1, math.floor(self.share * len(self.members)))


class ReplicaHealth:
    """One replica's health. Pure: the caller passes `now` (monotonic seconds)."""

    def __init__(self, policy: HealthPolicy, limit: EjectionLimit | None = None) -> None:
        if policy.failures_to_eject < 1:
            raise ValueError("failures_to_eject must be at least 1")
        if policy.rate_window_s <= 0 or policy.rate_min_requests < 1:
            raise ValueError("the failure-rate window needs a positive length and volume")
        self.policy = policy
        self.limit = limit if limit is not None else EjectionLimit(policy.max_ejected_share)
        self.limit.members.append(self)
        self.streak = 0  # consecutive gateway failures since the last success
        self.run = 0  # ejections since the last success: the backoff's exponent
        self.ejected_until = 0.0
        self.last_failure: float | None = None
        self.ejections = 0
        self.answered = False
        self._window_start = 0.0
        self._requests = 0
        self._gateway_failures = 0
        self._server_failures: dict[str, int] = {}

    # -- what happened ----------------------------------------------------------------------

    def failed(self, now: float, kind: str = "gateway", tenant: str = "") -> None:
        """A request failed on this replica: `kind` as `failure_kind` says ("gateway" for a
        timeout or a lost connection too), `tenant` the one whose request it was."""
        self.last_failure = now
        if now < self.ejected_until:
            return
        self._count(now)
        if kind == "gateway":
            self._gateway_failures += 1
            self.streak += 1
            if self.streak >= self.policy.failures_to_eject:
                self._eject(now)
                return
        else:
            failures = self._server_failures
            if tenant in failures or len(failures) < MAX_TENANTS_TRACKED:
                failures[tenant] = failures.get(tenant, 0) + 1
        if self._rate_exceeded():
            self._eject(now)

    def succeeded(self, now: float) -> None:
        """A request came back well: the streak and the run are over, any ejection lifted."""
        self._count(now)
        self.answered = True
        self.streak = 0
        self.run = 0
        self.ejected_until = min(self.ejected_until, now)

    def probe_ok(self, now: float) -> None:
        """An active probe answered: healthy again, as after a success (not counted as one)."""
        self.answered = True
        self.streak = 0
        self.run = 0
        self.ejected_until = min(self.ejected_until, now)

    def heard(self) -> None:
        """The server answered something (its `/metrics`, an error with a body): it is up."""
        self.answered = True

    # -- what it is -------------------------------------------------------------------------

    def healthy(self, now: float) -> bool:
        """Takes requests (a replica still starting does)."""
        return now >= self.ejected_until

    def state(self, now: float) -> str:
        if not self.healthy(now):
            return "ejected"
        return "healthy" if self.answered else "starting"

    # -- inside -----------------------------------------------------------------------------

    def _count(self, now: float) -> None:
        if now - self._window_start >= self.policy.rate_window_s:
            self._window_start = now
            self._requests = self._gateway_failures = 0
            self._server_failures = {}
        self._requests += 1

    def _rate_exceeded(self) -> bool:
        if self._requests < self.policy.rate_min_requests:
            return False
        failures = self._gateway_failures
        if len(self._server_failures) >= 2:  # other tenants see them too: the replica's
            failures += sum(self._server_failures.values())
        return failures >= self.policy.rate_threshold * self._requests

    def _eject(self, now: float) -> None:
        if not self.limit.allows(now):
            return  # too much of the pool is out already: this one keeps serving
        backoff = self.policy.base_eject_s * 2.0 ** min(self.run, _MAX_EXPONENT)
        self.ejected_until = now + min(backoff, self.policy.max_eject_s)
        self.run += 1
        self.ejections += 1
