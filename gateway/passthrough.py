"""Every other `/v1/*` path (responses, embeddings, files, ...) goes to an `openai`-kind route
as it is, so an application using any part of the OpenAI SDK keeps working."""

from __future__ import annotations

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.errors import GatewayError
from gateway.request_body import read_body
from gateway.routes import RouteTable
from gateway.upstreams.openai import OpenAIUpstream

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", "authorization", "x-api-key",
    "accept-encoding",
})
RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                           "content-encoding"})


def _model_of(raw: bytes, content_type: str) -> str | None:
    if not raw or "json" not in content_type:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


async def passthrough(request: Request, table: RouteTable, upstreams: dict, max_bytes: int,
                      path: str) -> Response:
    raw = await read_body(request, max_bytes)
    model = _model_of(raw, request.headers.get("content-type", ""))
    route = None
    if model is not None:
        route = table.match(model)
        if route is not None and route.kind != "openai":
            route = None
    route = route or table.first_of_kind("openai")
    if route is None:
        raise GatewayError(404, f"No OpenAI-compatible route serves /v1/{path}.",
                           code="no_passthrough_route")
    upstream: OpenAIUpstream = upstreams[route.name]
    headers = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
    headers.update({k: v for k, v in upstream.headers().items() if k != "content-type"})
    url = f"{upstream.base_url}/{path}"
    try:
        resp = await upstream.session.request(request.method, url, params=request.query_params,
                                               data=raw or None, headers=headers)
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise GatewayError(503, f"upstream {route.name!r} unreachable ({type(exc).__name__})") from None
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in RESPONSE_DROP}
    if "text/event-stream" in resp.headers.get("content-type", ""):
        out_headers.update({"cache-control": "no-cache, no-transform", "x-accel-buffering": "no"})
    return StreamingResponse(_relay(resp), status_code=resp.status, headers=out_headers)


async def _relay(resp: aiohttp.ClientResponse):
    """The upstream body as it arrives; closing the generator (client gone) closes upstream."""
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    finally:
        resp.close()
