"""Read side of telemetry: the per-tenant JSON endpoint and Prometheus exposition.

A tenant sees only its own figures; asking for another tenant is a 403, never an empty success.
Admin keys (`FIRSTTOKEN_ADMIN_KEYS`) may read any tenant, or all with `?tenant=*`.
`?api=chat|completions|responses|messages` keeps only the requests of one client API.
Admins (and an open gateway) also get each replicated route's replicas: state, load, requests,
affinity hits, ejections, mean upstream TTFT, and hedges sent, won and lost.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import GatewayError
from gateway.telemetry.event import APIS

if TYPE_CHECKING:
    from gateway.service import Gateway

log = logging.getLogger("firsttoken.metrics")

MAX_WINDOW_S = 31 * 86400
MAX_TENANT_CHARS = 256


def _window(request: Request) -> int:
    raw = request.query_params.get("window", "3600")
    # str.isdigit() accepts '²' and other digits int() refuses: ASCII digits only, few of them.
    if not raw.isascii() or not raw.isdigit() or len(raw) > 8 or not 0 < int(raw) <= MAX_WINDOW_S:
        raise GatewayError(
            400,
            f"'window' must be an integer number of seconds in 1..{MAX_WINDOW_S}.",
            param="window",
        )
    return int(raw)


def _asked_tenant(request: Request) -> str | None:
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


def _exposition(gateway: Gateway, gzipped: bool) -> tuple[bytes, str]:
    body, content_type = gateway.telemetry.prometheus_exposition()
    return (gzip.compress(body, compresslevel=5) if gzipped else body), content_type


def metrics_endpoints(gateway: Gateway) -> list[Route]:
    async def ttft(request: Request) -> Response:
        try:
            window = _window(request)
            asked = _asked_tenant(request)
            api = _api(request)
            admin = gateway.keys.is_admin(request)
            if admin:
                tenant = asked or "default"
            else:
                tenant = gateway.keys.tenant_for(request)
                if asked is not None and asked != tenant:
                    raise GatewayError(
                        403,
                        "A tenant may read only its own metrics.",
                        param="tenant",
                        code="forbidden_tenant",
                    )
            report = await gateway.telemetry.report(tenant, window, api)
            if gateway.fleets and (admin or gateway.keys.open):
                # Fleet-wide (every tenant's requests): for operators only.
                report["replicas"] = gateway.fleet_states()
        except GatewayError as exc:
            return exc.to_response()
        except Exception as exc:  # noqa: BLE001  # a failing store degrades this endpoint only
            log.warning("metrics store unavailable: %s", type(exc).__name__)
            return GatewayError(
                503,
                "The metrics store is unavailable; try again shortly.",
                code="metrics_store_unavailable",
            ).to_response()
        return Response(orjson.dumps(report), media_type="application/json")

    async def prometheus(request: Request) -> Response:
        if not gateway.keys.open and not gateway.keys.is_admin(request):
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
        body, content_type = await asyncio.to_thread(_exposition, gateway, gzipped)
        headers = {"content-type": content_type}
        if gzipped:
            headers["content-encoding"] = "gzip"
        return Response(body, media_type=None, headers=headers)

    return [
        Route("/v1/metrics/ttft", ttft, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
