"""The hedge budget and the p95 tracker, and a replicated route from a config file."""

from __future__ import annotations

from pathlib import Path

from gateway.config.settings import load_settings
from gateway.upstreams.replicas.hedging import P95_MIN_SAMPLES, HedgeBudget, TtftTracker


def test_hedges_stay_within_their_share_of_requests() -> None:
    budget = HedgeBudget(0.1)
    allowed = 0
    for i in range(1000):
        now = i * 0.01  # 100 requests a second for 10 s, each asking to hedge
        budget.request(now)
        allowed += budget.allow(now)
    assert 90 <= allowed <= 100


def test_old_requests_leave_the_window() -> None:
    budget = HedgeBudget(0.5)
    for i in range(100):
        budget.request(i * 0.1)
    assert budget.allow(10.0)
    assert not HedgeBudget(0.5).allow(0.0)  # no request seen: no hedge
    late = 200.0  # a minute and more later the old requests no longer pay for hedges
    budget.request(late)
    assert not budget.allow(late)


def test_p95_waits_for_enough_samples_then_follows_them() -> None:
    tracker = TtftTracker()
    for _ in range(P95_MIN_SAMPLES - 1):
        tracker.add(0.1)
    assert tracker.p95 is None
    for i in range(200):
        tracker.add(1.0 if i % 10 == 0 else 0.1)  # 10% slow
    assert tracker.p95 == 1.0
    for _ in range(256):
        tracker.add(0.2)
    assert tracker.p95 == 0.2


def test_a_replicated_route_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "firsttoken.toml"
    path.write_text(
        """
[[routes]]
name = "fleet"
models = ["llama-*"]
kind = "openai"
balance = "least_loaded"
hedge_after_ms = "p95"
load_metrics = "sglang"

[[routes.replicas]]
name = "gpu0"
base_url = "http://127.0.0.1:8000/v1"

[[routes.replicas]]
base_url = "http://127.0.0.1:8001/v1"
weight = 2
api_key_env = "GPU1_KEY"
"""
    )
    settings = load_settings(environ={"GPU1_KEY": "sk-1"}, config_file=path)
    (route,) = settings.routes
    assert route.balance == "least_loaded" and route.hedge_after_ms == "p95"
    assert route.replica_names() == ["gpu0", "1"] and route.replicas[1].weight == 2
    assert settings.captured("GPU1_KEY") == "sk-1"
