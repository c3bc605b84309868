"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API as a door,
so that an application holding the `anthropic` SDK points its `base_url` at the gateway.

The request goes to the `anthropic` route that serves its `model`, in Anthropic's own format,
byte for byte unless the route's `model_map` renames the model (so the client's `cache_control`
breakpoints and everything else it sent arrive as sent). The door keeps the guarantees of the
chat path:

- the tenant comes from its key (`x-api-key` or `Authorization: Bearer`), which never goes
  upstream; the route's key does, to the route's own origin only (`Upstream.forward`);
- the body is bounded like chat's (bytes, JSON containers and depth, `model`, `messages`);
- only `anthropic-version` (default 2023-06-01) and `anthropic-beta` of the client's headers
  are forwarded;
- the route's timeout bounds the whole exchange, and a client that leaves closes the upstream
  request at once;
- the answer is relayed within limits, in Anthropic's shapes (`messages_relay`);
- each `messages` request is recorded in telemetry once, with its TTFT and usage.

Not in this slice: `openai` and `local` routes (a 400), policies, retries and fallbacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.routing import Route as HttpRoute
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.messages_relay import MessagesRelay, send_error
from gateway.proxy import wait_for_disconnect
from gateway.request_body import parse_json, read_body, require_model
from gateway.request_id import next_request_id
from gateway.routes import Route
from gateway.timing import RequestTiming
from gateway.upstream_paths import PassPath, fixed_path
from gateway.upstreams.anthropic import ANTHROPIC_VERSION
from gateway.upstreams.base import UpstreamError

if TYPE_CHECKING:
    from gateway.service import Gateway

log = logging.getLogger("firsttoken.messages")

MESSAGES = fixed_path("messages")
COUNT_TOKENS = fixed_path("messages", "count_tokens")


def messages_endpoints(gateway: Gateway) -> list[HttpRoute]:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens`; each answers with the ASGI
    response that performs the exchange (it needs `receive` and `send` itself)."""

    async def messages(request: Request) -> MessagesExchange:
        return MessagesExchange(request, gateway, MESSAGES)

    async def count_tokens(request: Request) -> MessagesExchange:
        return MessagesExchange(request, gateway, COUNT_TOKENS)

    return [
        HttpRoute("/v1/messages", messages, methods=["POST"]),
        HttpRoute("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


def forward_headers(request: Request) -> dict[str, str]:
    """What the upstream gets of the client's headers: the API version and beta flags only."""
    headers = {
        "content-type": "application/json",
        "anthropic-version": request.headers.get("anthropic-version") or ANTHROPIC_VERSION,
    }
    beta = request.headers.get("anthropic-beta")
    if beta:
        headers["anthropic-beta"] = beta
    return headers


def status_kind(status: int) -> str:
    """A failed request's telemetry status (see `gateway.telemetry.event.STATUSES`)."""
    if status == 504:
        return "timeout"
    return "client_error" if 400 <= status < 500 and status != 429 else "upstream_error"


class MessagesExchange:
    """One Messages API request, as a raw ASGI response so that the status line, the upstream
    connection and the client's departure are all in its hands."""

    def __init__(self, request: Request, gateway: Gateway, path: PassPath) -> None:
        self.request = request
        self.gateway = gateway
        self.settings = gateway.settings
        self.path = path
        self.request_id = next_request_id()
        self.timing: RequestTiming | None = None
        self.relay: MessagesRelay | None = None
        self.client_gone = False
        self.finished = False
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Future | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival, wall_arrival = time.perf_counter(), time.time()
        self._task = asyncio.current_task()
        try:
            tenant = self.gateway.keys.tenant_for(self.request)
            raw = await read_body(self.request, self.settings.max_body_bytes)
            self._watch_disconnect(receive)
            body, model, stream = self._parse(raw)
            route = self._route(model)
            await self.gateway.upstream_ready(route.name)
            self.timing = RequestTiming(
                tenant, model, stream, arrival=arrival, wall_arrival=wall_arrival
            )
            self.timing.route = route.name
            self.relay = MessagesRelay(
                send, self.timing, self.request_id, route.name, self.settings
            )
            data = self._upstream_body(raw, body, model, route)
            await self._exchange(route, data, stream)
        except asyncio.CancelledError:
            if not self.client_gone or self._task is None:
                raise
            self._task.uncancel()
            if self.timing is not None:
                self.timing.status = "client_gone"
        except GatewayError as exc:
            await self._fail(send, exc)
        except Exception:  # a bug fails this request alone, with a clean 500 (logged)
            log.exception("request %s: unhandled error on %s", self.request_id, scope["path"])
            await self._fail(send, GatewayError(500, "Internal gateway error."))
        finally:
            self.finished = True
            if self._watcher is not None:
                self._watcher.cancel()
            self._record()

    # -- the request ---------------------------------------------------------------------

    def _parse(self, raw: bytes) -> tuple[dict, str, bool]:
        """(body, model, stream), within the same limits as chat; a 400 naming what is wrong."""
        settings = self.settings
        body = parse_json(raw, settings.max_json_depth, settings.max_json_containers)
        model = require_model(body, settings.max_model_chars)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise GatewayError(400, "'messages' is required and must be an array.")
        if len(messages) > settings.max_messages:
            raise GatewayError(
                400,
                f"'messages' has more than {settings.max_messages} entries "
                "(FIRSTTOKEN_MAX_MESSAGES).",
            )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise GatewayError(400, "'stream' must be a boolean.")
        return body, model, self.path is MESSAGES and stream is True

    def _route(self, model: str) -> Route:
        """The `anthropic` route serving `model`: a 404 when none serves it, a 400 when the
        route is of another kind (the request is never sent to the wrong provider's shape)."""
        table = self.gateway.table
        route = table.match(model)
        if route is None:
            if not table.routes:
                raise GatewayError(503, "No route is configured (FIRSTTOKEN_ROUTES).")
            raise GatewayError(404, f"The model '{model}' is not served by any route.")
        if route.kind != "anthropic":
            raise GatewayError(
                400,
                f"The model '{model}' is served by route {route.name!r} ({route.kind}); "
                f"/v1/messages serves anthropic routes only: translation to {route.kind} "
                "routes is not supported yet.",
            )
        return route

    @staticmethod
    def _upstream_body(raw: bytes, body: dict, model: str, route: Route) -> bytes:
        """The client's bytes as they came, unless the route renames the model."""
        upstream_model = route.upstream_model(model)
        if upstream_model == model:
            return raw
        try:
            return orjson.dumps({**body, "model": upstream_model})
        except orjson.JSONEncodeError as exc:
            raise GatewayError(
                400, f"The request body cannot be encoded as JSON ({exc})."
            ) from None

    # -- the exchange --------------------------------------------------------------------

    async def _exchange(self, route: Route, data: bytes, stream: bool) -> None:
        assert self.timing is not None and self.relay is not None
        upstream = self.gateway.upstreams[route.name]
        headers = forward_headers(self.request)
        timeout = route.timeout_s or self.settings.timeout_s
        try:
            async with asyncio.timeout(timeout):
                self.timing.upstream_sent = time.perf_counter()
                try:
                    resp = await upstream.forward("POST", self.path, headers, data)
                except UpstreamError as exc:
                    raise GatewayError(exc.status, exc.message) from None
                try:
                    await self.relay.answer(resp, stream)
                finally:
                    if resp.content.at_eof():
                        resp.release()
                    else:  # never back to the pool half-read; the upstream sees us leave
                        resp.close()
        except TimeoutError:
            raise GatewayError(
                504, f"Upstream {route.name!r} did not answer within {timeout}s."
            ) from None

    async def _fail(self, send: Send, exc: GatewayError) -> None:
        level = logging.INFO if 400 <= exc.status < 500 else logging.WARNING
        log.log(level, "request %s failed: %s", self.request_id, exc.message)
        if self.timing is not None and self.timing.status == "ok":
            self.timing.status = status_kind(exc.status)
        if self.relay is not None:
            await self.relay.error(exc)
        else:
            await send_error(send, exc, self.request_id)

    # -- the client's side ---------------------------------------------------------------

    def _watch_disconnect(self, receive: Receive) -> None:
        """From here on, a client that leaves cancels the exchange (closing the upstream)."""
        self._watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future) -> None:
        if self.finished or watcher.cancelled() or watcher.exception() is not None:
            return
        self.client_gone = True
        if self._task is not None:
            self._task.cancel()

    def _record(self) -> None:
        """One telemetry event per `messages` request that reached a route (count_tokens is
        not a generation and is not recorded); telemetry never fails the request."""
        if self.timing is None or self.path is not MESSAGES:
            return
        try:
            self.gateway.telemetry.record(self.timing.to_event())
        except Exception as exc:  # noqa: BLE001  # telemetry must never fail the response
            log.warning(
                "telemetry event of request %s lost: %s", self.request_id, type(exc).__name__
            )
