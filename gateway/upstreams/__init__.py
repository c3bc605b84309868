"""Upstream kinds: `openai` (any OpenAI-compatible server), `anthropic`, and `local` (the
bundled engine)."""

from __future__ import annotations

from gateway.routes import Route
from gateway.settings import Settings
from gateway.upstreams.base import (
    CallContext,
    Completed,
    EventStream,
    OutEvent,
    Upstream,
    UpstreamError,
    UpstreamTimeout,
)


def build_upstream(route: Route, settings: Settings) -> Upstream:
    """The upstream for `route`; its key comes from the settings, which read it at load."""
    if route.kind == "local":
        from gateway.upstreams.local import LocalUpstream

        return LocalUpstream(
            route,
            device=settings.engine_device,
            dtype=settings.engine_dtype,
            isolate_tenants=settings.isolate_engine_tenants(),
            max_num_batched_tokens=settings.engine_max_num_batched_tokens,
        )
    from gateway.upstreams.anthropic import AnthropicUpstream
    from gateway.upstreams.openai import OpenAIUpstream

    kind = AnthropicUpstream if route.kind == "anthropic" else OpenAIUpstream
    return kind(
        route,
        api_key=settings.route_api_key(route),
        pool_size=settings.pool_size,
        connect_timeout_s=settings.connect_timeout_s,
        max_event_bytes=settings.max_event_bytes,
        max_response_bytes=settings.max_response_bytes,
    )


__all__ = [
    "CallContext",
    "Completed",
    "EventStream",
    "OutEvent",
    "Upstream",
    "UpstreamError",
    "UpstreamTimeout",
    "build_upstream",
]
