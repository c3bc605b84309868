"""The configured routes' upstreams, started once: which route serves a model, with which
fallbacks, and whether each has started.

A route whose start-up failed is reported (by `/readyz` and a 503 to its requests) instead of
stopping the gateway, and a fallback that failed to start is skipped rather than failing the
request.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.config.routes import Route, RouteTable
from gateway.config.settings import Settings
from gateway.errors import GatewayError
from gateway.upstreams.base import Upstream
from gateway.upstreams.build import build_upstream

log = logging.getLogger("firsttoken")

NO_ROUTE_HELP = (
    "No route is configured. Set OPENAI_API_KEY, ANTHROPIC_API_KEY, GEMINI_API_KEY or "
    "DEEPSEEK_API_KEY, or "
    "FIRSTTOKEN_ROUTES (a JSON list of routes), or install the local engine "
    "(pip install 'firsttoken[engine]') to serve a local model."
)


class Upstreams:
    """One upstream per route of `table`, and the task that started each."""

    def __init__(self, table: RouteTable, settings: Settings) -> None:
        self.table = table
        self.by_route: dict[str, Upstream] = {
            r.name: build_upstream(r, settings) for r in table.routes
        }
        self._started: dict[str, asyncio.Task] = {}

    def __getitem__(self, route_name: str) -> Upstream:
        return self.by_route[route_name]

    def __bool__(self) -> bool:
        return bool(self.by_route)

    def start(self) -> list[asyncio.Task]:
        """Start every route in the background; the tasks are what readiness waits for."""
        for name, upstream in self.by_route.items():
            self._started[name] = asyncio.ensure_future(_start(upstream))
        return list(self._started.values())

    async def aclose(self) -> None:
        for task in self._started.values():
            task.cancel()
        await asyncio.gather(*(u.aclose() for u in self.by_route.values()), return_exceptions=True)

    async def ready(self, name: str) -> None:
        """Wait for route `name` to have started; a 503 when its start-up failed."""
        task = self._started.get(name)
        if task is None:
            return
        try:
            await asyncio.shield(task)  # a client that leaves must not cancel the start-up
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # whatever broke the start-up, the route is down
            raise GatewayError(
                503, f"route {name!r} failed to start ({type(exc).__name__})"
            ) from None

    async def _usable(self, route: Route) -> bool:
        try:
            await self.ready(route.name)
        except GatewayError:
            return False
        return True

    async def chain_for(self, model: str) -> list[Route]:
        """The route serving `model` and its fallbacks that started; 404 when none serves it."""
        route = self.table.match(model)
        if route is None:
            if not self.table.routes:
                raise GatewayError(503, NO_ROUTE_HELP, code="no_route_configured")
            raise GatewayError(
                404,
                f"The model '{model}' is not served by any route.",
                param="model",
                code="model_not_found",
            )
        await self.ready(route.name)
        return [route, *[r for r in self.table.chain(route)[1:] if await self._usable(r)]]

    def states(self) -> dict[str, str]:
        """Each route's start-up: `starting`, `ready` or `failed: <reason>`."""
        states = {}
        for name, task in self._started.items():
            if not task.done():
                states[name] = "starting"
            elif task.cancelled() or task.exception() is not None:
                reason = "cancelled" if task.cancelled() else type(task.exception()).__name__
                states[name] = f"failed: {reason}"
            else:
                states[name] = "ready"
        return states


async def _start(upstream: Upstream) -> None:
    """Start one route; a failure is logged here (for the operator) and kept on the task,
    which `/readyz` reports and requests for the route answer with a 503."""
    name = upstream.route.name
    try:
        await upstream.start()
    except Exception as exc:
        log.error("route %s failed to start: %s: %s", name, type(exc).__name__, exc)
        raise
    try:
        await upstream.warm_up()
    except Exception as exc:  # noqa: BLE001  # a cold route is slower, not down
        log.warning("warm-up of route %s failed: %s", name, type(exc).__name__)
