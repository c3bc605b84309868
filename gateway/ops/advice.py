"""`GET /v1/metrics/cache-advice`: which policy opt-in would pay, per prefix family.

Same rules as `/v1/metrics/ttft`: a tenant sees only its own families (asking for another is a
403); an admin key may name any tenant with `?tenant=`, or all with `?tenant=*`. `?window=`
(seconds, default 3600) is clamped to the advice kept (`ADVICE_RETENTION_S`, a day, or the
metrics retention if shorter) and rounded out to whole advisor buckets (`ADVICE_BUCKET_S`); a read
shares the metrics reads' budget (`gateway.ops.metrics.ReadBudget`). See `gateway.advisor` for
how the figures are made and what they estimate.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.advisor import advisor_for, bucket_of, tenant_advice
from gateway.boundary.admit import Admission
from gateway.ops.metrics import ReadBudget, asked_tenant, json_answer, window_param
from gateway.telemetry.store import ADVICE_BUCKET_S, ADVICE_RETENTION_S

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry
    from policies.config import PolicyOptions


async def _tenant_answer(telemetry: Telemetry, tenant: str, window: int) -> dict:
    last = bucket_of(time.time())
    first = last - (window + ADVICE_BUCKET_S - 1) // ADVICE_BUCKET_S + 1
    per_family = await telemetry.read_advice(tenant, first, last)
    return tenant_advice(tenant, per_family, window)


def advice_endpoints(
    admission: Admission,
    telemetry: Telemetry,
    policy_options: PolicyOptions,
    budget: ReadBudget | None = None,
) -> list[Route]:
    # The variants add their opt-in to the options this gateway runs with.
    advisor_for(telemetry).configure(policy_options)
    reads = budget or ReadBudget()
    retained = min(admission.settings.metrics_retention, ADVICE_RETENTION_S)

    async def cache_advice(request: Request) -> Response:
        async def read() -> dict:
            window = window_param(request, retained_s=retained)
            tenant, _ = admission.reader(request, asked_tenant(request), "cache advice")
            async with reads.hold(tenant):
                if tenant != "*":
                    return await _tenant_answer(telemetry, tenant, window)
                tenants = await telemetry.known_tenants()
                answers = [await _tenant_answer(telemetry, t, window) for t in tenants]
            return {"window_s": window, "tenants": [a for a in answers if a["families"]]}

        return await json_answer(read, "cache advice")

    return [Route("/v1/metrics/cache-advice", cache_advice, methods=["GET"])]
