"""Read side of telemetry: the per-tenant JSON endpoint and Prometheus exposition.

A tenant sees only its own figures; asking for another tenant is a 403, never an empty success.
Admin keys (`FIRSTTOKEN_ADMIN_KEYS`) may read any tenant, or all with `?tenant=*`.
`?api=chat|completions|responses|messages` keeps only the requests of one client API.
Admins (and an open gateway) also get each replicated route's replicas: state, load, requests,
affinity hits, ejections, mean upstream TTFT, and hedges sent, won and lost.
`/v1/metrics/ttft/series` gives the same figures per step of the window, under the same rules
(`gateway/telemetry/series.py`), with `?step=` and `?route=` besides.

A read costs the gateway work per retained minute, and any tenant may ask for the longest window,
so one read is bounded twice: its window is clamped to what the store keeps
(`FIRSTTOKEN_METRICS_RETENTION`, 7 days; the answer's `window_s` says what was read), and
`ReadBudget` lets each tenant run one read at a time and the gateway `MAX_CONCURRENT_READS`
(a tenant with `MAX_WAITING_READS` already queued gets a 429), so a tenant's reads in a loop take
a bounded share of the serving loop and queue behind each other, not in front of other tenants.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.boundary.admit import Admission
from gateway.errors import GatewayError
from gateway.telemetry.event import APIS
from gateway.telemetry.series import MAX_STEP_S, MIN_STEP_S, MIN_WINDOW_S, series_problem

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry

log = logging.getLogger("firsttoken.metrics")

MAX_WINDOW_S = 31 * 86400
MAX_TENANT_CHARS = 256
MAX_ROUTE_CHARS = 256
MAX_CONCURRENT_READS = 1  # metrics and advice reads running at once, all tenants together
MAX_WAITING_READS = 4  # a tenant's reads queued behind its running one; past it, 429


class ReadBudget:
    """One read at a time per tenant, `MAX_CONCURRENT_READS` for the gateway. Made per app (its
    semaphores belong to the app's event loop); shared by the metrics and advice endpoints."""

    def __init__(self, concurrent: int = MAX_CONCURRENT_READS) -> None:
        self._all = asyncio.Semaphore(concurrent)
        self._tenants: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}

    @asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        waiting = self._waiting.get(tenant, 0)
        if waiting > MAX_WAITING_READS:
            raise GatewayError(
                429,
                "Too many metrics reads in flight for this tenant; wait for one to finish.",
                code="too_many_metrics_reads",
            )
        own = self._tenants.setdefault(tenant, asyncio.Semaphore(1))
        self._waiting[tenant] = waiting + 1
        try:
            async with own, self._all:
                yield
        finally:
            left = self._waiting[tenant] - 1
            if left:
                self._waiting[tenant] = left
            else:  # the table holds only tenants with a read in flight
                del self._waiting[tenant]
                self._tenants.pop(tenant, None)


def _seconds(request: Request, name: str, default: str, low: int, high: int) -> int:
    raw = request.query_params.get(name, default)
    # str.isdigit() accepts '²' and other digits int() refuses: ASCII digits only, few of them.
    if not raw.isascii() or not raw.isdigit() or len(raw) > 8 or not low <= int(raw) <= high:
        raise GatewayError(
            400,
            f"'{name}' must be an integer number of seconds in {low}..{high}.",
            param=name,
        )
    return int(raw)


def window_param(request: Request, low: int = 1, retained_s: int = MAX_WINDOW_S) -> int:
    """`?window=` in seconds (a 400 outside `low..MAX_WINDOW_S`), clamped to `retained_s`: a
    window past what the store keeps would read only empty buckets."""
    return min(_seconds(request, "window", "3600", low, MAX_WINDOW_S), max(low, retained_s))


def asked_tenant(request: Request) -> str | None:
    asked = request.query_params.get("tenant")
    if asked is not None and not (0 < len(asked) <= MAX_TENANT_CHARS and asked.isprintable()):
        raise GatewayError(
            400,
            f"'tenant' must be a tenant name of 1..{MAX_TENANT_CHARS} "
            "printable characters, or '*'.",
            param="tenant",
        )
    return asked


def _api(request: Request) -> str | None:
    asked = request.query_params.get("api")
    if asked is not None and asked not in APIS:
        raise GatewayError(400, f"'api' must be one of {', '.join(APIS)}.", param="api")
    return asked


def _route(request: Request) -> str | None:
    asked = request.query_params.get("route")
    if asked is not None and not (0 < len(asked) <= MAX_ROUTE_CHARS and asked.isprintable()):
        raise GatewayError(
            400,
            f"'route' must be a route name of 1..{MAX_ROUTE_CHARS} printable characters.",
            param="route",
        )
    return asked


def _series_window(request: Request, retained_s: int) -> tuple[int, int]:
    window = window_param(request, low=MIN_WINDOW_S, retained_s=retained_s)
    step = _seconds(request, "step", "60", MIN_STEP_S, MAX_STEP_S)
    problem = series_problem(window, step)
    if problem is not None:
        raise GatewayError(400, problem[1], param=problem[0])
    return window, step


def _exposition(telemetry: Telemetry, gzipped: bool) -> tuple[bytes, str]:
    body, content_type = telemetry.prometheus_exposition()
    return (gzip.compress(body, compresslevel=5) if gzipped else body), content_type


async def json_answer(
    read: Callable[[], Awaitable[object]], what: str = "metrics store"
) -> Response:
    """`read()` as JSON; its GatewayError as itself; any other failure (the store down) as a
    503, so that a failing store degrades the read endpoints only, never the proxy."""
    try:
        answer = await read()
    except GatewayError as exc:
        return exc.to_response()
    except Exception as exc:  # noqa: BLE001  # a failing store degrades this endpoint only
        log.warning("%s unavailable: %s", what, type(exc).__name__)
        return GatewayError(
            503,
            "The metrics store is unavailable; try again shortly.",
            code="metrics_store_unavailable",
        ).to_response()
    return Response(orjson.dumps(answer), media_type="application/json")


def metrics_endpoints(
    admission: Admission,
    telemetry: Telemetry,
    fleets: Callable[[], dict[str, dict]],
    budget: ReadBudget | None = None,
) -> list[Route]:
    """TTFT figures (JSON, series) for tenants and admins, Prometheus for admins; `fleets`:
    each replicated or pd route's fleet figures, for operators; `budget`: the reads' share."""
    reads = budget or ReadBudget()
    retained = admission.settings.metrics_retention

    async def ttft(request: Request) -> Response:
        async def read() -> dict:
            window = window_param(request, retained_s=retained)
            asked = asked_tenant(request)
            api = _api(request)
            tenant, admin = admission.reader(request, asked)
            async with reads.hold(tenant):
                report = await telemetry.report(tenant, window, api)
            states = fleets()
            if states and (admin or admission.open):
                # Fleet-wide (every tenant's requests): for operators only.
                report["replicas"] = states
            return report

        return await json_answer(read)

    async def ttft_series(request: Request) -> Response:
        async def read() -> dict:
            window, step = _series_window(request, retained)
            asked = asked_tenant(request)
            api = _api(request)
            route = _route(request)
            tenant, _ = admission.reader(request, asked)
            async with reads.hold(tenant):
                return await telemetry.series(tenant, window, step, route, api)

        return await json_answer(read)

    async def prometheus(request: Request) -> Response:
        if not admission.open and not admission.is_admin(request):
            return GatewayError(
                401,
                "/metrics needs an admin key (FIRSTTOKEN_ADMIN_KEYS).",
                code="admin_key_required",
            ).to_response()
        # Rendering is CPU work proportional to the series; in a worker thread the loop keeps
        # serving between the interpreter's switches instead of waiting for the whole body.
        # A scrape of many tenants runs to megabytes of text: rendered (and gzipped, when the
        # scraper takes it, as Prometheus does) off the event loop.
        gzipped = "gzip" in request.headers.get("accept-encoding", "").lower()
        body, content_type = await asyncio.to_thread(_exposition, telemetry, gzipped)
        headers = {"content-type": content_type}
        if gzipped:
            headers["content-encoding"] = "gzip"
        return Response(body, media_type=None, headers=headers)

    return [
        Route("/v1/metrics/ttft", ttft, methods=["GET"]),
        Route("/v1/metrics/ttft/series", ttft_series, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
