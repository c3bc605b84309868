"""Prometheus series of replicated routes, read from the fleets at scrape time.

Labels are the route's and the replicas' configured names (never their URLs), so the series
are bounded by the configuration, not by traffic.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.upstreams.replicas.fleet import Fleet


class FleetCollector(Collector):
    def __init__(self, fleets: Mapping[str, Fleet]) -> None:
        self.fleets = fleets

    def collect(self) -> Iterator[Metric]:
        labels = ["route", "replica"]
        healthy = GaugeMetricFamily(
            "firsttoken_replica_healthy",
            "1 when the replica takes requests, 0 when ejected.",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "firsttoken_replica_in_flight",
            "Requests the gateway has open on the replica.",
            labels=labels,
        )
        requests = CounterMetricFamily(
            "firsttoken_replica_requests",
            "Requests sent to the replica (hedges included).",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "firsttoken_replica_affinity_hits",
            "Requests sent to the replica because it held part of their prefix.",
            labels=labels,
        )
        ejections = CounterMetricFamily(
            "firsttoken_replica_ejections", "Times the replica was ejected.", labels=labels
        )
        ttft = SummaryMetricFamily(
            "firsttoken_replica_upstream_ttft_seconds",
            "The replica's upstream TTFTs (request sent to first content): sum and count.",
            labels=labels,
        )
        hedges = CounterMetricFamily(
            "firsttoken_hedges",
            "Hedged first tokens: sent, won (the hedge answered first), lost.",
            labels=["route", "outcome"],
        )
        waits = SummaryMetricFamily(
            "firsttoken_prefix_wait_seconds",
            "Requests held until another request's first token had computed their prefix on "
            "their replica, and the seconds they waited.",
            labels=["route"],
        )
        for route, fleet in self.fleets.items():
            snapshot = fleet.snapshot()
            for replica in snapshot["replicas"]:
                values = [route, replica["name"]]
                member = fleet.members[replica["name"]]
                healthy.add_metric(values, 0.0 if replica["state"] == "ejected" else 1.0)
                in_flight.add_metric(values, replica["in_flight"])
                requests.add_metric(values, replica["requests"])
                hits.add_metric(values, replica["affinity_hits"])
                ejections.add_metric(values, replica["ejections"])
                ttft.add_metric(values, member.stats.ttft_count, member.stats.ttft_sum_s)
            for outcome, count in snapshot["hedges"].items():
                hedges.add_metric([route, outcome], count)
            held = snapshot.get("prefix_waits")  # replicated routes; the prefill/decode router not
            if held is not None:
                waits.add_metric([route], held["requests"], held["waited_ms"] / 1000)
        yield from (healthy, in_flight, requests, hits, ejections, ttft, hedges, waits)
