"""Passive ejection with exponential backoff, half-open return, probes."""

from __future__ import annotations

import pytest

from gateway.upstreams.replicas.health import (
    EjectionLimit,
    HealthPolicy,
    ReplicaHealth,
    failure_kind,
)


def test_backoff_doubles_while_failures_continue_and_is_capped() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=1.0, max_eject_s=10.0))
    now, lengths = 0.0, []
    for _ in range(6):
        health.failed(now)
        lengths.append(health.ejected_until - now)
        now = health.ejected_until  # half-open: the next request fails again
    assert lengths == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert health.ejections == 6 and health.last_failure == now - 10.0


def test_ejected_then_half_open_after_the_time_passes() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=2.0))
    health.heard()
    assert health.healthy(0.0) and health.state(0.0) == "healthy"
    health.failed(10.0)
    assert not health.healthy(11.9) and health.state(11.9) == "ejected"
    assert health.healthy(12.0) and health.state(12.0) == "healthy"


def test_failures_while_ejected_do_not_lengthen_the_ejection() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=1.0))
    health.failed(0.0)
    health.failed(0.1)  # a request that was in flight when it broke
    health.failed(0.2)
    assert health.ejected_until == 1.0 and health.ejections == 1
    assert health.last_failure == 0.2
    health.failed(1.5)
    assert health.ejected_until == 3.5


def test_success_resets_the_streak_and_lifts_the_ejection() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=1.0))
    health.failed(0.0)
    health.failed(1.0)
    assert health.ejected_until == 3.0
    health.succeeded(1.5)
    assert health.healthy(1.5)
    health.failed(2.0)
    assert health.ejected_until == 3.0  # back to the base backoff


def test_probe_brings_an_ejected_replica_back_at_once() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=30.0))
    health.failed(0.0)
    assert not health.healthy(5.0)
    health.probe_ok(5.0)
    assert health.healthy(5.0)
    health.failed(6.0)
    assert health.ejected_until == 36.0


def test_failures_to_eject_tolerates_isolated_errors() -> None:
    health = ReplicaHealth(HealthPolicy(base_eject_s=1.0, failures_to_eject=3))
    health.failed(0.0)
    health.failed(0.1)
    assert health.healthy(0.1) and health.ejections == 0
    health.failed(0.2)
    assert not health.healthy(0.2) and health.ejected_until == pytest.approx(1.2)
    health.failed(1.2)
    assert health.ejected_until == pytest.approx(3.2)


def test_policy_is_checked() -> None:
    with pytest.raises(ValueError):
        ReplicaHealth(HealthPolicy(failures_to_eject=0))


# -- outlier detection: the replica's own failures, not one tenant's requests ------------------


def pool_of(n: int, **policy: object) -> list[ReplicaHealth]:
    """`n` replicas sharing one ejection limit, as a `ServerPool`'s do."""
    p = HealthPolicy(**policy)  # type: ignore[arg-type]
    limit = EjectionLimit(p.max_ejected_share)
    return [ReplicaHealth(p, limit) for _ in range(n)]


def test_server_errors_of_one_tenant_never_eject_however_many() -> None:
    health = ReplicaHealth(HealthPolicy(rate_min_requests=5))
    for i in range(50):  # the bad tenant's 500s, in a row, with nobody else in between
        health.failed(i * 0.01, failure_kind(500), "bad-tenant")
    assert health.healthy(1.0) and health.ejections == 0


def test_server_errors_that_several_tenants_see_eject_by_rate() -> None:
    health = ReplicaHealth(HealthPolicy(rate_min_requests=10, rate_threshold=0.5))
    now = 0.0
    for i in range(9):
        now += 0.01
        health.failed(now, "server", f"tenant-{i % 3}")
    assert health.healthy(now)  # under the minimum volume: no verdict yet
    health.failed(now + 0.01, "server", "tenant-0")
    assert not health.healthy(now + 0.01) and health.ejections == 1


def test_the_rate_counts_within_its_window_only() -> None:
    health = ReplicaHealth(HealthPolicy(rate_min_requests=10, rate_window_s=10.0))
    for i in range(6):
        health.succeeded(float(i))
    for i in range(3):
        health.failed(20.0 + i, "server", f"t{i}")  # a new window: 3 requests, under volume
    assert health.healthy(23.0)


def test_consecutive_gateway_failures_eject_and_a_success_in_between_resets() -> None:
    health = ReplicaHealth(HealthPolicy(failures_to_eject=3))
    health.failed(0.0, failure_kind(502))
    health.failed(0.1, failure_kind(504))
    health.succeeded(0.2)
    health.failed(0.3, failure_kind(503))
    health.failed(0.4, failure_kind(502))
    assert health.healthy(0.4)
    health.failed(0.5, failure_kind(502))
    assert not health.healthy(0.5)


def test_failure_kinds() -> None:
    assert [failure_kind(s) for s in (400, 404, 422, 429, 500, 501, 502, 503, 504)] == [
        None,
        None,
        None,
        None,
        "server",
        "server",
        "gateway",
        "gateway",
        "gateway",
    ]


def test_at_most_the_max_share_of_a_pool_is_ejected() -> None:
    replicas = pool_of(4, max_ejected_share=0.5)
    for i, health in enumerate(replicas):
        health.failed(1.0 + i * 0.1)  # all four 502 at once
    assert sum(not h.healthy(1.5) for h in replicas) == 2
    assert [h.ejections for h in replicas] == [1, 1, 0, 0]
    assert replicas[0].healthy(2.0)  # its ejection ended: another may go now
    replicas[3].failed(2.4)
    assert not replicas[3].healthy(2.5)


def test_a_lone_replica_may_still_be_ejected() -> None:
    (only,) = pool_of(1, max_ejected_share=0.5)
    only.failed(0.0)
    assert not only.healthy(0.5)


def test_a_replica_that_never_answered_is_starting_not_healthy() -> None:
    health = ReplicaHealth(HealthPolicy())
    assert health.healthy(0.0) and health.state(0.0) == "starting"  # it may take requests
    health.heard()
    assert health.state(0.0) == "healthy"
    other = ReplicaHealth(HealthPolicy())
    other.probe_ok(0.0)
    assert other.state(0.0) == "healthy"
    third = ReplicaHealth(HealthPolicy())
    third.failed(0.0)
    assert third.state(0.5) == "ejected" and third.state(1.0) == "starting"
