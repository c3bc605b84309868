"""Prometheus metrics on a private registry, updated on the request path.

The registry is private so that two gateways in one process (tests, embedding) never collide,
and so `/metrics` shows only this gateway.

Labels are bounded. The first `max_tenants` tenants seen keep their name, later ones are
folded into `other`. A model name comes from the client (any name a route's pattern accepts),
so each tenant label keeps its first `max_models` model names and folds later ones into
`other`: a tenant sending made-up names can fold only its own models, never another's. The
`api` label is the client API (`chat`, `completions`, `responses`, `messages`: four fixed values,
set by the gateway; any other is refused as a bug). Label children are cached per (tenant,
route, model, api), so recording costs a dictionary lookup and a few additions.

Buckets. `firsttoken_ttft_seconds` has one bucket per bucket of the store's histogram between
1 ms and 30 s (`TTFT_BUCKETS_S`, 4% steps, 265 bounds, plus 6 coarse ones outside), so
`histogram_quantile` over it lands within about 2% of the JSON endpoint's figures (see
`histogram.store_bounds`), a local upstream's 1-3 ms TTFTs included. That costs 274 series per
(tenant, route, model, api) that has streamed.
The other duration histograms use every fourth of those bounds (`COARSE_BUCKETS_S`, 17% steps,
up to about 20% from the JSON figures, 76 series each); the JSON endpoint is the precise source
for them. A child is exposed only once it holds an observation, so a route that only streams
costs no `complete` series. A streaming (tenant, route, model, api) costs about 370 series in
all (TTFT 274, upstream TTFT 76, gateway share 15, counters 6): 100 tenants x 2 routes x 3
models over one API is 220k series (each further API a tenant streams through adds its own),
about 21 MB of text, rendered in about 0.4-0.6 s off the event loop. No `_created` series: the
process-wide `disable_created_metrics()` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .aggregate import checked_api, utf8_text
from .event import STATUSES, RequestEvent
from .histogram import store_bounds
from .latency_histogram import LatencyChild, LatencyHistogram

# `_created` doubles the counter series for a timestamp no dashboard reads. prometheus_client
# reads this switch (or PROMETHEUS_DISABLE_CREATED_SERIES at its import) when it renders, so
# setting it here holds for every way the gateway starts; it is process-wide by design.
disable_created_metrics()

# From 1 ms: a local upstream's TTFT is 1-3 ms, and a quantile of it read from buckets that
# start at 10 ms would be interpolated inside the 0-10 ms bucket, 50-70% off.
_BELOW = (0.00025, 0.0005)
_ABOVE = (60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS_S = (*_BELOW, *store_bounds(0.001, 30.0), *_ABOVE)
COARSE_BUCKETS_S = (*_BELOW, *store_bounds(0.001, 30.0, every=4), *_ABOVE)
# The gateway's own share is sub-millisecond to tens of ms: few buckets, wide apart.
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

OTHER = "other"  # the label value of folded tenants and models
DEFAULT_MAX_TENANTS = 100
DEFAULT_MAX_MODELS = 10  # model label values per tenant label, `other` aside
LABEL_MAX_CHARS = 200
_KNOWN_STATUSES = frozenset(STATUSES)
_ROUTE_LABELS = ("tenant", "route", "model", "api")


def label_value(value: str) -> str:
    """A label value that cannot break the exposition: bounded, valid UTF-8."""
    return utf8_text(str(value)[:LABEL_MAX_CHARS])


@dataclass(slots=True)
class _RouteChildren:
    ttft: LatencyChild
    upstream_ttft: LatencyChild
    gateway: LatencyChild
    complete: LatencyChild
    output_tokens: Any
    prompt_tokens: Any
    cached_tokens: Any
    saved_tokens: Any
    fallbacks: Any


class PrometheusMetrics:
    def __init__(
        self, max_tenants: int = DEFAULT_MAX_TENANTS, max_models: int = DEFAULT_MAX_MODELS
    ) -> None:
        if max_tenants < 1 or max_models < 1:
            raise ValueError("max_tenants and max_models must be at least 1")
        self.max_tenants = max_tenants
        self.max_models = max_models
        self.registry = CollectorRegistry(auto_describe=False)
        labels = _ROUTE_LABELS
        r = self.registry
        self.ttft = LatencyHistogram(
            "firsttoken_ttft_seconds",
            "Arrival to first content byte written, streams.",
            labels,
            TTFT_BUCKETS_S,
        )
        self.upstream_ttft = LatencyHistogram(
            "firsttoken_upstream_ttft_seconds",
            "Upstream request sent to its first content event.",
            labels,
            COARSE_BUCKETS_S,
        )
        self.gateway = LatencyHistogram(
            "firsttoken_gateway_seconds",
            "The gateway's own share of TTFT (TTFT minus upstream TTFT).",
            labels,
            GATEWAY_BUCKETS_S,
        )
        self.complete = LatencyHistogram(
            "firsttoken_complete_seconds",
            "Arrival to complete response, non-stream requests.",
            labels,
            COARSE_BUCKETS_S,
        )
        self.passthrough_seconds = LatencyHistogram(
            "firsttoken_passthrough_seconds",
            "Arrival to last byte of requests to other /v1 paths, by path family.",
            ("tenant", "family"),
            COARSE_BUCKETS_S,
        )
        self.histograms = (
            self.ttft,
            self.upstream_ttft,
            self.gateway,
            self.complete,
            self.passthrough_seconds,
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
        self._tenants: set[str] = set()
        self._models: dict[str, set[str]] = {}  # tenant label -> its model labels
        self._children: dict[tuple[str, str, str, str], _RouteChildren] = {}
        self._statuses: dict[tuple[str, str, str, str, str], tuple[Any, Any | None]] = {}

    def tenant_label(self, tenant: str) -> str:
        """The tenant's label value, or `other` once `max_tenants` others hold a label."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER

    def model_label(self, tenant_label: str, model: str) -> str:
        """The model's label value under one tenant label, or `other` once `max_models`
        others hold one there."""
        models = self._models.setdefault(tenant_label, set())
        if model in models:
            return model
        if len(models) < self.max_models:
            models.add(model)
            return model
        return OTHER

    def _labels(self, tenant: str, route: str, model: str, api: str) -> tuple[str, str, str, str]:
        tenant_label = self.tenant_label(label_value(tenant))
        model_label = self.model_label(tenant_label, label_value(model))
        return tenant_label, label_value(route), model_label, api

    def _route_children(self, tenant: str, route: str, model: str, api: str) -> _RouteChildren:
        key = (tenant, route, model, api)
        children = self._children.get(key)
        if children is None:
            labels = self._labels(tenant, route, model, api)
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

    def _status_children(
        self, tenant: str, route: str, model: str, api: str, status: str
    ) -> tuple[Any, Any | None]:
        key = (tenant, route, model, api, status)
        pair = self._statuses.get(key)
        if pair is None:
            labels = (*self._labels(tenant, route, model, api), status)
            pair = (
                self.requests.labels(*labels),
                self.errors.labels(*labels) if status != "ok" else None,
            )
            if len(self._statuses) < self.max_tenants * 256:
                self._statuses[key] = pair
        return pair

    def observe(self, event: RequestEvent) -> None:
        """Count one event; an `api` outside `APIS` raises ValueError, counting nothing."""
        api = checked_api(event.api)
        children = self._route_children(event.tenant, event.route, event.model, api)
        status = event.status if event.status in _KNOWN_STATUSES else "other"
        requests, errors = self._status_children(
            event.tenant, event.route, event.model, api, status
        )
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

    def observe_prefix_break(self, tenant: str, kind: str) -> None:
        """Count a prompt prefix that stopped matching the tenant's last one."""
        tenant_label = self.tenant_label(label_value(tenant))
        self.prefix_breaks.labels(tenant_label, label_value(kind)[:64]).inc()

    def observe_passthrough(self, tenant: str, family: str, status: int, seconds: float) -> None:
        """One passthrough request. `family` comes from a fixed allow-list (or `invalid`), so
        with the folded tenant label the series stay bounded."""
        tenant_label = self.tenant_label(label_value(tenant))
        family = label_value(family)
        self.passthrough_requests.labels(tenant_label, family, f"{status // 100}xx").inc()
        self.passthrough_seconds.labels(tenant_label, family).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The `/metrics` body: the registry's counters and gauges, then the histograms."""
        histograms = "".join(h.render() for h in self.histograms)
        return generate_latest(self.registry) + histograms.encode(), CONTENT_TYPE_LATEST
