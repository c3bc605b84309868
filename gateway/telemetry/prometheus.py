"""Prometheus metrics on a private registry, updated on the request path.

The registry is private so that two gateways in one process (tests, embedding)
never collide, and so `/metrics` shows only this gateway. Tenant label values are
bounded: the first `max_tenants` tenants seen keep their name, later ones are
folded into `other`, so a stream of new tenant names cannot grow the exposition
without limit. Label children are cached per (tenant, route) so recording costs a
dictionary lookup and a few additions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .event import STATUSES, RequestEvent

# Dense between 50 ms and 2 s, where TTFT lives; sparse on either side.
TTFT_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
GATEWAY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
OTHER_TENANT = "other"
LABEL_MAX_CHARS = 200
_KNOWN_STATUSES = frozenset(STATUSES)


@dataclass(slots=True)
class _RouteChildren:
    ttft: Any
    upstream_ttft: Any
    gateway: Any
    complete: Any
    output_tokens: Any
    prompt_tokens: Any
    cached_tokens: Any
    saved_tokens: Any
    fallbacks: Any


class PrometheusMetrics:
    def __init__(self, max_tenants: int = 100) -> None:
        self.max_tenants = max_tenants
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ("tenant", "route")
        r = self.registry
        self.ttft = Histogram(
            "firsttoken_ttft_seconds",
            "Arrival to first content byte written, streams.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.upstream_ttft = Histogram(
            "firsttoken_upstream_ttft_seconds",
            "Upstream request sent to its first content event.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.gateway = Histogram(
            "firsttoken_gateway_seconds",
            "The gateway's own share of TTFT (TTFT minus upstream TTFT).",
            labels,
            buckets=GATEWAY_BUCKETS_S,
            registry=r,
        )
        self.complete = Histogram(
            "firsttoken_complete_seconds",
            "Arrival to complete response, non-stream requests.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "firsttoken_requests_total",
            "Requests by final status.",
            (*labels, "status"),
            registry=r,
        )
        self.errors = Counter(
            "firsttoken_errors_total",
            "Requests that did not end ok, by status.",
            (*labels, "status"),
            registry=r,
        )
        self.output_tokens = Counter(
            "firsttoken_output_tokens_total",
            "Output tokens streamed or returned.",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "firsttoken_prompt_tokens_total",
            "Prompt tokens reported by upstreams.",
            labels,
            registry=r,
        )
        self.cached_tokens = Counter(
            "firsttoken_cached_prompt_tokens_total",
            "Prompt tokens upstreams served from cache.",
            labels,
            registry=r,
        )
        self.saved_tokens = Counter(
            "firsttoken_prompt_tokens_saved_total",
            "Prompt tokens removed by policies.",
            labels,
            registry=r,
        )
        self.fallbacks = Counter(
            "firsttoken_fallbacks_total", "Requests served by a fallback route.", labels, registry=r
        )
        self.prefix_breaks = Counter(
            "firsttoken_prefix_breaks_total",
            "Prompt prefixes that stopped matching the tenant's last one.",
            ("tenant", "kind"),
            registry=r,
        )
        self.dropped = Counter(
            "firsttoken_telemetry_dropped_total",
            "Telemetry events lost (buffer full or store failed).",
            registry=r,
        )
        self.buffered = Gauge(
            "firsttoken_telemetry_buffered", "Telemetry events waiting for the store.", registry=r
        )
        self.passthrough_requests = Counter(
            "firsttoken_passthrough_requests_total",
            "Requests to other /v1 paths (files, batches, responses, ...) by path family and "
            "status class.",
            ("tenant", "family", "status"),
            registry=r,
        )
        self.passthrough_seconds = Histogram(
            "firsttoken_passthrough_seconds",
            "Arrival to last byte of requests to other /v1 paths, by path family.",
            ("tenant", "family"),
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self._tenants: set[str] = set()
        self._children: dict[tuple[str, str], _RouteChildren] = {}
        self._statuses: dict[tuple[str, str, str], tuple[Any, Any | None]] = {}

    def tenant_label(self, tenant: str) -> str:
        """The tenant's label value, or `other` once `max_tenants` others hold a label."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    def _route_children(self, tenant: str, route: str) -> _RouteChildren:
        key = (tenant, route)
        children = self._children.get(key)
        if children is None:
            labels = (self.tenant_label(tenant)[:LABEL_MAX_CHARS], route[:LABEL_MAX_CHARS])
            children = _RouteChildren(
                self.ttft.labels(*labels),
                self.upstream_ttft.labels(*labels),
                self.gateway.labels(*labels),
                self.complete.labels(*labels),
                self.output_tokens.labels(*labels),
                self.prompt_tokens.labels(*labels),
                self.cached_tokens.labels(*labels),
                self.saved_tokens.labels(*labels),
                self.fallbacks.labels(*labels),
            )
            if len(self._children) < self.max_tenants * 64:  # bound the cache, not the metrics
                self._children[key] = children
        return children

    def _status_children(self, tenant: str, route: str, status: str) -> tuple[Any, Any | None]:
        key = (tenant, route, status)
        pair = self._statuses.get(key)
        if pair is None:
            labels = (self.tenant_label(tenant)[:LABEL_MAX_CHARS], route[:LABEL_MAX_CHARS], status)
            pair = (
                self.requests.labels(*labels),
                self.errors.labels(*labels) if status != "ok" else None,
            )
            if len(self._statuses) < self.max_tenants * 256:
                self._statuses[key] = pair
        return pair

    def observe(self, event: RequestEvent) -> None:
        children = self._route_children(event.tenant, event.route)
        status = event.status if event.status in _KNOWN_STATUSES else "other"
        requests, errors = self._status_children(event.tenant, event.route, status)
        requests.inc()
        if errors is not None:
            errors.inc()
        if event.stream:
            if event.ttft_s is not None:
                children.ttft.observe(event.ttft_s)
                if event.upstream_ttft_s is not None:
                    children.gateway.observe(max(0.0, event.ttft_s - event.upstream_ttft_s))
        elif status == "ok":
            children.complete.observe(event.total_s)
        if event.upstream_ttft_s is not None:
            children.upstream_ttft.observe(event.upstream_ttft_s)
        if event.output_tokens:
            children.output_tokens.inc(event.output_tokens)
        if event.prompt_tokens:
            children.prompt_tokens.inc(event.prompt_tokens)
        if event.cached_prompt_tokens:
            children.cached_tokens.inc(event.cached_prompt_tokens)
        if event.prompt_tokens_saved:
            children.saved_tokens.inc(event.prompt_tokens_saved)
        if event.fallback:
            children.fallbacks.inc()

    def observe_passthrough(self, tenant: str, family: str, status: int, seconds: float) -> None:
        """One passthrough request. `family` comes from a fixed allow-list (or `invalid`), so
        with the folded tenant label the series stay bounded."""
        tenant_label = self.tenant_label(tenant)[:LABEL_MAX_CHARS]
        family = family[:LABEL_MAX_CHARS]
        self.passthrough_requests.labels(tenant_label, family, f"{status // 100}xx").inc()
        self.passthrough_seconds.labels(tenant_label, family).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
