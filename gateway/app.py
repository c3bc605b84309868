"""The ASGI application: which door serves which path, each door handed the parts it uses."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.boundary.request_id import RequestIdMiddleware, request_id_from
from gateway.config.settings import Settings, load_settings
from gateway.doors.chat import ChatDoor
from gateway.doors.messages import COUNT_TOKENS, MESSAGES, MessagesDoor, anthropic_error
from gateway.doors.models import models_endpoints
from gateway.doors.passthrough import Exchange
from gateway.doors.responses import ResponsesDoor
from gateway.errors import GatewayError
from gateway.ops.advice import advice_endpoints
from gateway.ops.dashboard import dashboard_endpoints
from gateway.ops.metrics import ReadBudget, metrics_endpoints
from gateway.runtime import Runtime

log = logging.getLogger("firsttoken")


def json_response(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def create_app(settings: Settings | None = None) -> HotPath:
    """The app for `settings` (default: `load_settings()`, the process environment)."""
    runtime = Runtime(settings or load_settings())
    admission = runtime.admission
    doors = Doors(
        chat=ChatDoor(admission, runtime.pipeline),
        responses=ResponsesDoor(
            admission, runtime.pipeline, runtime.preparation, runtime.passthrough
        ),
        messages=MessagesDoor(
            admission, runtime.pipeline, runtime.preparation, runtime.upstreams, runtime.settings
        ),
    )

    async def chat_completions(request: Request) -> ASGIApp:
        return await doors.chat(request, "chat")

    async def completions(request: Request) -> ASGIApp:
        return await doors.chat(request, "completions")

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = runtime.ready()
        # A degraded telemetry store is reported, not fatal: requests flow without it.
        return json_response(
            {
                "ready": ready,
                "routes": runtime.upstreams.states(),
                "replicas": runtime.replica_health(),
                "telemetry": runtime.telemetry.health(),
            },
            200 if ready else 503,
        )

    async def other_v1(request: Request) -> ASGIApp:
        admitted = admission.begin(request, "passthrough")
        try:
            admission.authenticate(admitted)
        except GatewayError as exc:
            return exc.to_response()
        return Exchange(admitted, runtime.passthrough)  # path checks and errors inside

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.aclose()

    reads = ReadBudget()  # the metrics and advice reads' share of the loop, shared by both
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),  # via HotPath
        Route("/v1/completions", completions, methods=["POST"]),
        # /v1/responses and /v1/messages: HotPath only (`HotPath.door`)
        *models_endpoints(admission, runtime.upstreams, lambda: runtime.started_at),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *metrics_endpoints(admission, runtime.telemetry, runtime.fleet_states, reads),
        *advice_endpoints(admission, runtime.telemetry, runtime.settings.policy_options, reads),
        *dashboard_endpoints(admission),
        Route("/v1/{path:path}", other_v1, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(RequestIdMiddleware)],
        # Starlette types the handlers' exception parameter as plain Exception.
        exception_handlers={HTTPException: http_error, Exception: internal_error},  # type: ignore[dict-item]
    )
    app.state.runtime = runtime
    return HotPath(app, doors)


@dataclass(frozen=True)
class Doors:
    """The generation doors, each a converter around the one admission and pipeline."""

    chat: ChatDoor
    responses: ResponsesDoor
    messages: MessagesDoor


# With or without a trailing slash: the variant must not slip past validation, policies and
# telemetry into passthrough.
HOT_PATHS = {
    path + slash: endpoint
    for path, endpoint in {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/responses": "responses",
        "/v1/messages": "messages",
        "/v1/messages/count_tokens": "count_tokens",
    }.items()
    for slash in ("", "/")
}
ANTHROPIC_DOORS = frozenset({"messages", "count_tokens"})


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
    """The generation doors (chat, completions, responses, messages) skip Starlette's
    middleware stack.

    Each middleware layer wraps `send`, and a stream calls `send` once per event, so on the hot
    path those layers cost more than all of the gateway's own work. Everything else, lifespan
    included, goes to the Starlette app.
    """

    def __init__(self, app: Starlette, doors: Doors) -> None:
        self.app = app
        self.state = app.state
        self.doors = doors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        anthropic = endpoint in ANTHROPIC_DOORS
        if scope["method"] != "POST":
            # GET /v1/chat/completions is OpenAI's stored-completions list: not served here.
            refused = method_not_allowed(scope["method"], scope["path"], "POST")
            request_id = request_id_from(Headers(scope=scope))
            if anthropic:
                error = GatewayError(405, orjson.loads(refused.body)["error"]["message"])
                refused = anthropic_error(error, request_id)
                refused.headers["allow"] = "POST"
            refused.headers["x-request-id"] = request_id
            await refused(scope, receive, send)
            return
        response: ASGIApp
        try:
            response = await self.door(Request(scope, receive), endpoint)
        except Exception:  # a bug fails this request alone, with a clean 500
            request_id = request_id_from(Headers(scope=scope))
            log.exception("request %s: unhandled error on %s", request_id, scope["path"])
            error = GatewayError(500, "Internal gateway error.")
            response = (
                anthropic_error(error, request_id) if anthropic else error.to_response(request_id)
            )
        await response(scope, receive, send)

    async def door(self, request: Request, endpoint: str) -> ASGIApp:
        if endpoint == "responses":
            return await self.doors.responses(request)
        if endpoint in ANTHROPIC_DOORS:
            path = MESSAGES if endpoint == "messages" else COUNT_TOKENS
            return await self.doors.messages(request, path)
        return await self.doors.chat(request, endpoint)
