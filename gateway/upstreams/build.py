"""The upstream for a route: its kind, and for a replicated or pd route, one server each."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.config.errors import SettingsError
from gateway.config.routes import GOOGLE_CREDENTIALS_VARIABLE, Replica, Route
from gateway.config.settings import Settings
from gateway.upstreams.base import Upstream

if TYPE_CHECKING:
    from gateway.upstreams.pd.router import Pairing, PDUpstream


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

    options: dict[str, Any] = {
        "pool_size": settings.pool_size,
        "connect_timeout_s": settings.connect_timeout_s,
        "max_event_bytes": settings.max_event_bytes,
        "max_response_bytes": settings.max_response_bytes,
    }

    if route.kind == "gemini":
        from gateway.upstreams.gemini import GeminiUpstream

        return GeminiUpstream(route, api_key=settings.route_api_key(route), **options)
    if route.kind == "vertex":
        return vertex_upstream(route, settings, options)

    def one_server(replica: Replica) -> OpenAIUpstream:
        # Each replica (or prefill/decode server) is reached like a one-server route of its
        # own: its URL, its key (else the route's), the route's headers under its own.
        one = route.model_copy(
            update={
                "base_url": replica.base_url,
                "api_key_env": replica.api_key_env or route.api_key_env,
                "headers": {**route.headers, **replica.headers},
                "replicas": (),
                "pd": None,
            }
        )
        return OpenAIUpstream(one, api_key=settings.route_api_key(one), **options)

    if route.pd is not None:
        from gateway.upstreams.pd.router import PDUpstream

        return PDUpstream(
            route,
            [one_server(r) for r in route.pd.prefill],
            [one_server(r) for r in route.pd.decode],
            pd_pairing(route.pd.protocol),
        )
    if route.replicas:
        from gateway.upstreams.replicas.fleet import ReplicatedUpstream

        return ReplicatedUpstream(route, [one_server(r) for r in route.replicas])
    if route.kind == "bedrock":
        from gateway.upstreams.bedrock import BedrockUpstream

        return BedrockUpstream(route, **options)
    if route.kind == "azure":
        from gateway.upstreams.azure import AzureUpstream

        return AzureUpstream(route, api_key=settings.route_api_key(route), **options)
    kind = AnthropicUpstream if route.kind == "anthropic" else OpenAIUpstream
    return kind(route, api_key=settings.route_api_key(route), **options)


def vertex_upstream(route: Route, settings: Settings, options: dict[str, Any]) -> Upstream:
    """A vertex route's upstream; google-auth (the `vertex` extra) is imported only now, and
    its absence is a start-up error that says what to install."""
    from gateway.upstreams.google_token import EXTRA_HINT, google_auth_installed

    if not google_auth_installed():
        raise SettingsError(
            f"FIRSTTOKEN_ROUTES: route {route.name!r} is of kind vertex, which needs google-auth "
            f"for its credentials: {EXTRA_HINT}"
        )
    from gateway.upstreams.vertex import VertexUpstream

    return VertexUpstream(
        route, credentials_file=settings.captured(GOOGLE_CREDENTIALS_VARIABLE), **options
    )


def pd_pairing(protocol: str) -> Callable[[PDUpstream], Pairing]:
    """The `Pairing` of a pd route's `pd.protocol`. It is chosen here, where the route is
    built, so that the router knows neither protocol and each protocol only the router."""
    if protocol == "sglang":
        from gateway.upstreams.pd.sglang import SGLangPairing

        return SGLangPairing
    if protocol == "vllm":
        from gateway.upstreams.pd.vllm import VLLMPairing

        return VLLMPairing
    raise ValueError(f"unknown pd protocol {protocol!r}")
