"""A chat or completions request once the gateway has decided everything about it.

`PreparedRequest` is what the proxy gets: the route chain, the upstream body for each route,
and the response headers (some measured while the upstream request is in flight). The proxy
asks it; it never reaches back into the doors, the policy runner or telemetry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config.routes import Route
from gateway.upstreams.base import UpstreamBody


class RouteBodies(Protocol):
    """The upstream body for each route of a chain."""

    def for_route(self, route: Route) -> UpstreamBody: ...


@dataclass(eq=False)
class PreparedRequest:
    """Everything decided about a request before any upstream is called."""

    endpoint: str  # "chat" | "completions": the upstream API it is sent as
    tenant: str
    request_id: str  # what the answer names (the client's own, when well-formed)
    model: str  # as the client named it
    chain: list[Route]
    bodies: RouteBodies
    client_wants_usage: bool
    response_headers: dict[str, str] = field(default_factory=dict)
    forward_headers: dict[str, str] = field(default_factory=dict)
    # Headers measured while the upstream request is in flight (tokens saved, prefix breaks).
    report: asyncio.Future[dict[str, str]] | None = None
    own_id: str = ""  # the gateway's unique id, which upstreams get (`CallContext.request_id`)

    def body_for(self, route: Route) -> UpstreamBody:
        return self.bodies.for_route(route)

    async def headers(self) -> dict[str, str]:
        """The response headers, the measured ones included (waited for only here, when the
        status line is about to go out)."""
        if self.report is None:
            return self.response_headers
        return {**self.response_headers, **await self.report}
