"""Upstream kinds: `openai` (any OpenAI-compatible server), `anthropic`, and `local` (the bundled engine)."""

from __future__ import annotations

import os
from collections.abc import Mapping

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


def build_upstream(
    route: Route, settings: Settings, environ: Mapping[str, str] | None = None
) -> Upstream:
    environ = os.environ if environ is None else environ
    if route.kind == "local":
        from gateway.upstreams.local import LocalUpstream

        return LocalUpstream(
            route,
            device=settings.engine_device,
            dtype=settings.engine_dtype,
            isolate_tenants=settings.isolate_engine_tenants(),
            max_num_batched_tokens=settings.engine_max_num_batched_tokens,
        )
    options = dict(
        api_key=route.api_key(environ),
        pool_size=settings.pool_size,
        connect_timeout_s=settings.connect_timeout_s,
        max_event_bytes=settings.max_event_bytes,
        max_response_bytes=settings.max_response_bytes,
    )
    if route.kind == "anthropic":
        from gateway.upstreams.anthropic import AnthropicUpstream

        return AnthropicUpstream(route, **options)
    from gateway.upstreams.openai import OpenAIUpstream

    return OpenAIUpstream(route, **options)


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
