"""The policies on a body that goes upstream in its client's own API (Responses to an `openai`
route, Messages to an `anthropic` route), with the same chains, options and reports as chat.

The chain reads and rewrites the body in its own shape (`policies.shapes`); the upstream gets
the result under the route's model name and nothing else added (no `stream_options`: neither
API takes chat's). The token counts and prefix diagnostics run while the upstream request is in
flight, and their headers are added to the answer like chat's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request

from gateway.config.routes import Route
from gateway.errors import GatewayError
from gateway.pipeline.policies import POLICY_HEADER, report_headers
from gateway.telemetry.record import RequestTiming
from policies import PolicyContext

if TYPE_CHECKING:
    from gateway.runtime import Gateway
    from policies.chain import PolicyResult


@dataclass
class NativeBody:
    """The bytes to send and the policy headers of the answer."""

    data: bytes
    applied: str = "none"
    report: asyncio.Future[dict[str, str]] | None = field(default=None, repr=False)

    async def headers(self) -> dict[str, str]:
        """Waited for only when the status line is about to go out."""
        own = {POLICY_HEADER: self.applied}
        if self.report is None:
            return own
        return {**own, **await self.report}


async def native_body(
    gateway: Gateway,
    request: Request,
    route: Route,
    endpoint: str,
    raw: bytes,
    body: dict,
    timing: RequestTiming,
) -> NativeBody:
    """`body` with `route`'s policies applied (on the heavy-work pool when it is big), encoded;
    the client's bytes as they came when no policy runs and the model keeps its name."""
    model, tenant = timing.model, timing.tenant
    upstream_model = route.upstream_model(model)
    names = gateway.policies.names_for(route, request.headers.get(POLICY_HEADER))
    ctx = PolicyContext(
        endpoint=endpoint, route_kind=route.kind, model=upstream_model, tenant=tenant
    )
    heavy = gateway.offload.is_heavy(len(raw))
    if heavy:
        result = await gateway.offload.run(tenant, gateway.policies.apply, names, body, ctx)
    else:
        result = gateway.policies.apply(names, body, ctx)
    if result is None and upstream_model == model:
        return NativeBody(raw)
    out = dict(result.body if result is not None else body)
    out["model"] = upstream_model
    try:
        data = orjson.dumps(out)
    except orjson.JSONEncodeError as exc:
        raise GatewayError(400, f"The request body cannot be encoded as JSON ({exc}).") from None
    if result is None:
        return NativeBody(data)
    report = asyncio.ensure_future(
        report_headers(gateway.telemetry, tenant, result, gateway.offload if heavy else None)
    )
    report.add_done_callback(lambda _: _note_saved(timing, result))
    return NativeBody(data, ",".join(result.applied), report)


def _note_saved(timing: RequestTiming, result: PolicyResult) -> None:
    if result.measured:
        timing.prompt_tokens_saved = max(0, result.prompt_tokens_saved)
