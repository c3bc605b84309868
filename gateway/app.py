"""The ASGI application: endpoints wired to the `Gateway` service object."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import GatewayError
from gateway.metrics_api import metrics_endpoints
from gateway.passthrough import passthrough
from gateway.service import Gateway
from gateway.settings import Settings, load_settings

log = logging.getLogger("firsttoken")


def json_response(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def create_app(
    settings: Settings | None = None, environ: Mapping[str, str] | None = None
) -> HotPath:
    settings = settings or load_settings()
    gateway = Gateway(settings, environ)

    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "completions")

    async def models(request: Request) -> Response:
        try:
            gateway.keys.tenant_for(request)
        except GatewayError as exc:
            return exc.to_response()
        return json_response({"object": "list", "data": await list_models(gateway)})

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = gateway.ready()
        # A degraded telemetry store is reported, not fatal: requests flow without it.
        return json_response(
            {
                "ready": ready,
                "routes": gateway.route_states(),
                "telemetry": gateway.telemetry.health(),
            },
            200 if ready else 503,
        )

    async def other_v1(request: Request) -> Response:
        return await passthrough(request, gateway)  # auth, path checks and errors inside

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.aclose()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),  # via HotPath
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *metrics_endpoints(gateway),
        Route("/v1/{path:path}", other_v1, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.gateway = gateway
    return HotPath(app, gateway)


# With or without a trailing slash: the variant must not slip past validation, policies and
# telemetry into passthrough.
HOT_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/chat/completions/": "chat",
    "/v1/completions": "completions",
    "/v1/completions/": "completions",
}


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 and 405 (no route, wrong method), in OpenAI's shape."""
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")  # built from a set: sorted, stable
        allow = ", ".join(sorted(m.strip() for m in allowed.split(",") if m.strip()))
        return method_not_allowed(request.method, request.url.path, allow)
    if exc.status_code == 404:
        return GatewayError(
            404,
            f"Invalid URL ({request.method} {_shown(request.url.path)}).",
            type="invalid_request_error",
            code="unknown_url",
        ).to_response()
    return GatewayError(exc.status_code, exc.detail, type="invalid_request_error").to_response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """An unexpected exception: logged by the server, answered without internals."""
    return GatewayError(500, "Internal gateway error.").to_response()


def method_not_allowed(method: str, path: str, allow: str) -> Response:
    response = GatewayError(
        405,
        f"Method {method} is not allowed on {_shown(path)}"
        + (f"; allowed: {allow}." if allow else "."),
        type="invalid_request_error",
        code="method_not_allowed",
    ).to_response()
    if allow:
        response.headers["allow"] = allow
    return response


def _shown(path: str, limit: int = 200) -> str:
    return path if len(path) <= limit else path[:limit] + "..."


class HotPath:
    """Chat and completions POSTs skip Starlette's middleware stack.

    Each middleware layer wraps `send`, and a stream calls `send` once per event, so on the hot
    path those layers cost more than all of the gateway's own work. Everything else, lifespan
    included, goes to the Starlette app.
    """

    def __init__(self, app: Starlette, gateway: Gateway) -> None:
        self.app = app
        self.state = app.state
        self.gateway = gateway

    async def __call__(self, scope, receive, send) -> None:
        endpoint = HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            # GET /v1/chat/completions is OpenAI's stored-completions list: not served here.
            await method_not_allowed(scope["method"], scope["path"], "POST")(scope, receive, send)
            return
        try:
            response = await self.gateway.handle(Request(scope, receive), endpoint)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            response = GatewayError(500, "Internal gateway error.").to_response()
        await response(scope, receive, send)


async def list_models(gateway: Gateway) -> list[dict]:
    """What the routes serve: exact names, the local engine's own cards, and for a route with
    glob patterns the upstream's own list filtered by them (cached briefly; an upstream that
    does not answer in time only leaves its models out)."""
    seen: dict[str, dict] = {}
    created = int(time.time())
    for route in gateway.table.routes:
        upstream = gateway.upstreams[route.name]
        if route.kind == "local":
            with contextlib.suppress(GatewayError):
                await gateway.upstream_ready(route.name)
            for card in upstream.model_cards():
                seen.setdefault(card["id"], card)
        patterns = [name for name in route.models if any(ch in name for ch in "*?[")]
        for name in (*route.models, *route.model_map):
            if name not in patterns:
                seen.setdefault(
                    name,
                    {"id": name, "object": "model", "created": created, "owned_by": route.name},
                )
        if patterns and route.kind in ("openai", "anthropic"):
            for card in await upstream.model_cards():
                if route.matches(card["id"]):
                    seen.setdefault(card["id"], card)
    return list(seen.values())
