"""`GET /v1/metrics/cache-advice`: which policy opt-in would pay, per prefix family.

Same rules as `/v1/metrics/ttft`: a tenant sees only its own families (asking for another is a
403); an admin key may name any tenant with `?tenant=`, or all with `?tenant=*`. `?window=`
(seconds, default 3600) is rounded out to whole advisor buckets (`ADVICE_BUCKET_S`), and the
advisor keeps at most `ADVICE_RETENTION_S` of history. See `gateway.advisor` for how the figures
are made and what they estimate.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.advisor import advisor_for, bucket_of, tenant_advice
from gateway.errors import GatewayError
from gateway.metrics_api import _asked_tenant, _window
from gateway.telemetry.store import ADVICE_BUCKET_S

if TYPE_CHECKING:
    from gateway.service import Gateway

log = logging.getLogger("firsttoken.metrics")


async def _tenant_answer(gateway: Gateway, tenant: str, window: int) -> dict:
    last = bucket_of(time.time())
    first = last - (window + ADVICE_BUCKET_S - 1) // ADVICE_BUCKET_S + 1
    per_family = await gateway.telemetry.read_advice(tenant, first, last)
    return tenant_advice(tenant, per_family, window)


def advice_endpoints(gateway: Gateway) -> list[Route]:
    # The variants add their opt-in to the options this gateway runs with.
    advisor_for(gateway.telemetry).configure(gateway.settings.policy_options)

    async def cache_advice(request: Request) -> Response:
        try:
            window = _window(request)
            asked = _asked_tenant(request)
            if gateway.keys.is_admin(request):
                tenant = asked or "default"
            else:
                tenant = gateway.keys.tenant_for(request)
                if asked is not None and asked != tenant:
                    raise GatewayError(
                        403,
                        "A tenant may read only its own cache advice.",
                        param="tenant",
                        code="forbidden_tenant",
                    )
            if tenant == "*":
                tenants = await gateway.telemetry.known_tenants()
                answers = [await _tenant_answer(gateway, t, window) for t in tenants]
                answer: dict = {
                    "window_s": window,
                    "tenants": [a for a in answers if a["families"]],
                }
            else:
                answer = await _tenant_answer(gateway, tenant, window)
        except GatewayError as exc:
            return exc.to_response()
        except Exception as exc:  # noqa: BLE001  # a failing store degrades this endpoint only
            log.warning("cache advice unavailable: %s", type(exc).__name__)
            return GatewayError(
                503,
                "The metrics store is unavailable; try again shortly.",
                code="metrics_store_unavailable",
            ).to_response()
        return Response(orjson.dumps(answer), media_type="application/json")

    return [Route("/v1/metrics/cache-advice", cache_advice, methods=["GET"])]
