"""Prometheus series of `pd` routes' steps, read from the routers at scrape time.

The per-server series (health, in flight, requests, errors, per-server latency) come from
`gateway.upstreams.replicas.metrics.FleetCollector`, which reads a `PDUpstream` like a replicated
route (servers named `prefill/<name>` and `decode/<name>`). These add what only PD has: how often a
request went colocated and why, and the three step timings kept apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.upstreams.pd.router import PDUpstream

STEPS = ("prefill", "handoff", "decode_ttft")


class PDCollector(Collector):
    def __init__(self, routers: Mapping[str, PDUpstream]) -> None:
        self.routers = routers

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "firsttoken_pd_requests", "Requests a pd route served.", labels=["route"]
        )
        colocated = CounterMetricFamily(
            "firsttoken_pd_colocated",
            "Requests a pd route decoded without a remote prefill, by reason.",
            labels=["route", "reason"],
        )
        steps = SummaryMetricFamily(
            "firsttoken_pd_step_seconds",
            "Step durations: prefill (request to answer), handoff (prefill answer to decode "
            "request), decode_ttft (decode request to first content, streams only).",
            labels=["route", "step"],
        )
        for route, router in self.routers.items():
            s = router.stats
            requests.add_metric([route], s.requests)
            for reason, count in s.colocated.items():
                colocated.add_metric([route, reason], count)
            sums = (s.prefill_sum_s, s.handoff_sum_s, s.decode_ttft_sum_s)
            counts = (s.prefill_count, s.handoff_count, s.decode_ttft_count)
            for step, total, count in zip(STEPS, sums, counts, strict=True):
                steps.add_metric([route, step], count_value=count, sum_value=total)
        yield from (requests, colocated, steps)
