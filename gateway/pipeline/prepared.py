"""A chat or completions request once the gateway has decided everything about it.

`PreparedRequest` is what the proxy gets: the route chain, the upstream body for each route,
the response headers (some measured while the upstream request is in flight), and the one
finish step that records the request. The proxy asks it; it never reaches back into the
service, the policy runner or telemetry.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.boundary.body import upstream_body
from gateway.config.routes import Route
from gateway.telemetry.record import RequestTiming
from gateway.upstreams.base import EncodedBody, UpstreamBody
from policies import PolicyContext

if TYPE_CHECKING:
    from gateway.pipeline.policies import PolicyRunner
    from gateway.telemetry import Telemetry
    from policies.chain import PolicyResult

log = logging.getLogger("firsttoken.proxy")


class RouteBodies(Protocol):
    """The upstream body for each route of a chain."""

    def for_route(self, route: Route) -> UpstreamBody: ...


class PolicyBodies:
    """Bodies with each route's policies applied, built when a route is first tried: a
    fallback's body costs nothing unless the chain gets that far."""

    def __init__(
        self,
        runner: PolicyRunner,
        names: tuple[str, ...],
        body: dict,
        *,
        endpoint: str,
        tenant: str,
        model: str,
        stream: bool,
    ) -> None:
        self._runner = runner
        self._names = names
        self._body = body
        self._endpoint = endpoint
        self._tenant = tenant
        self._model = model
        self._stream = stream
        self._bodies: dict[str, UpstreamBody] = {}
        self.results: dict[str, PolicyResult | None] = {}

    def for_route(self, route: Route) -> UpstreamBody:
        cached = self._bodies.get(route.name)
        if cached is not None:
            return cached
        upstream_model = route.upstream_model(self._model)
        ctx = PolicyContext(
            endpoint=self._endpoint,
            route_kind=route.kind,
            model=upstream_model,
            tenant=self._tenant,
        )
        result = self._runner.apply(self._names, self._body, ctx)
        self.results[route.name] = result
        out = upstream_body(
            result.body if result is not None else self._body, upstream_model, self._stream
        )
        self._bodies[route.name] = out
        return out


class EncodedBodies:
    """Bodies a big-body worker process already built and encoded, one per route."""

    def __init__(self, bodies: dict[str, EncodedBody]) -> None:
        self._bodies = bodies

    def for_route(self, route: Route) -> UpstreamBody:
        return self._bodies[route.name]


@dataclass(eq=False)
class PreparedRequest:
    """Everything decided about a request before any upstream is called."""

    endpoint: str  # "chat" | "completions"
    tenant: str
    request_id: str
    model: str  # as the client named it
    chain: list[Route]
    bodies: RouteBodies
    client_wants_usage: bool
    telemetry: Telemetry
    response_headers: dict[str, str] = field(default_factory=dict)
    forward_headers: dict[str, str] = field(default_factory=dict)
    # Headers measured while the upstream request is in flight (tokens saved, prefix breaks).
    report: asyncio.Future[dict[str, str]] | None = None
    finished: bool = False

    def body_for(self, route: Route) -> UpstreamBody:
        return self.bodies.for_route(route)

    async def headers(self) -> dict[str, str]:
        """The response headers, the measured ones included (waited for only here, when the
        status line is about to go out)."""
        if self.report is None:
            return self.response_headers
        return {**self.response_headers, **await self.report}

    def finish(self, timing: RequestTiming) -> None:
        """Record the request once. Telemetry never fails a request: whatever goes wrong in it
        is logged (by type: the data came from an upstream), the response stands."""
        if self.finished:
            return
        self.finished = True
        try:
            self.telemetry.record(timing.to_event())
        except Exception as exc:  # noqa: BLE001  # telemetry must never fail the response
            log.warning(
                "telemetry event of request %s lost: %s", self.request_id, type(exc).__name__
            )
