"""Passive ejection with exponential backoff, half-open return, probes."""

from __future__ import annotations

import pytest

from gateway.upstreams.replicas.health import HealthPolicy, ReplicaHealth


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
