"""Every other `/v1/*` path (responses, embeddings, files, batches, ...) goes to an `openai`-kind
route, so an application using any part of the OpenAI SDK keeps working, with the guarantees of
the chat path:

- the path is validated raw and the upstream URL built from the route's base, never
  concatenated (`upstream_paths`); the route's key only ever goes to the route's own origin;
- client headers are allow-listed: never the client's key, account headers (OpenAI-Organization,
  OpenAI-Project), cookies, `X-Forwarded-*`, hop-by-hop headers or those named in `Connection`;
- the route's timeout bounds the whole exchange, and a client that leaves closes the upstream
  request at once (while uploading, waiting or streaming);
- JSON request bodies are bounded by FIRSTTOKEN_MAX_BODY_BYTES; multipart and raw uploads are
  streamed to the upstream, not buffered, within FIRSTTOKEN_MAX_UPLOAD_BYTES;
- the answer is relayed within limits (`passthrough_relay`);
- in tenant mode, objects belong to the tenant that created them (`ownership`);
- Anthropic's Files API (`/v1/files...` sent with an `anthropic-version` header, which the
  Anthropic SDK always sends and the OpenAI SDK never does) goes to an `anthropic` route: the
  one the file was created through, else the first configured; same rules otherwise;
- every request is counted with its latency per path family (Prometheus).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.boundary.admit import AdmittedRequest
from gateway.boundary.body import parse_json, read_body, strip_reserved
from gateway.boundary.client_watch import ClientWatch
from gateway.config.routes import ANTHROPIC_FAMILIES, PASSTHROUGH_KINDS, Route, RouteTable
from gateway.doors.messages_relay import anthropic_error_from_upstream, error_body
from gateway.doors.passthrough_relay import AnswerObserver, Relay, relay_answer
from gateway.errors import GatewayError
from gateway.paths import AZURE_FAMILIES, PassPath, parse_target
from gateway.translation.messages_chat import anthropic_error_type
from gateway.upstreams.base import Upstream, UpstreamError
from gateway.upstreams.registry import Upstreams

if TYPE_CHECKING:
    from gateway.boundary.ownership import Ownership
    from gateway.config.settings import Settings
    from gateway.telemetry import Telemetry

log = logging.getLogger("firsttoken.passthrough")

METHODS = frozenset({"GET", "POST", "DELETE"})
# Client headers that change what the upstream does; nothing else is forwarded.
FORWARD_HEADERS = ("accept", "openai-beta", "idempotency-key")
ANTHROPIC_FORWARD_HEADERS = ("accept", "anthropic-version", "anthropic-beta")
# Bodies streamed to the upstream as they arrive; every other body is JSON.
UPLOAD_TYPES = ("multipart/form-data", "application/octet-stream")


class _ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


def forward_headers(request: Request, allowed: tuple[str, ...] = FORWARD_HEADERS) -> dict[str, str]:
    """The allow-listed client headers, minus any the client's `Connection` header names."""
    headers = request.headers
    named = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    return {name: headers[name] for name in allowed if name in headers and name not in named}


def from_anthropic_client(request: Request, path: PassPath) -> bool:
    """An Anthropic SDK request for a family both providers name alike (`/v1/files`): told
    apart by `anthropic-version`, which that SDK sends on every request and OpenAI's never."""
    return path.family in ANTHROPIC_FAMILIES and "anthropic-version" in request.headers


def anthropic_error(exc: GatewayError) -> bytes:
    """A gateway error in Anthropic's shape, for an Anthropic client."""
    return error_body(exc.message, anthropic_error_type(exc.status))


def choose_anthropic_route(table: RouteTable, owner_route: str | None) -> Route:
    """The `anthropic` route the object was created through, else the first one configured
    (either only where its `passthrough` allows `files`)."""
    if owner_route is not None:
        route = table.by_name.get(owner_route)
        if route is not None and route.serves_anthropic_files():
            return route
    for route in table.routes:
        if route.serves_anthropic_files():
            return route
    raise GatewayError(
        404, "No anthropic route serves Anthropic's Files API.", code="no_passthrough_route"
    )


def choose_route(
    table: RouteTable, family: str, model: str | None, owner_route: str | None
) -> Route:
    """The route named by the body's model (a 400 when that route is not an `openai` or
    `azure` one), else the one the object was created through, else the first such route that
    forwards this family."""
    if model is not None:
        route = table.match(model)
        if route is not None and route.kind not in PASSTHROUGH_KINDS:
            # Never the wrong provider in silence: the model is this route's, and this route
            # kind has no /v1/<family> of its own.
            raise GatewayError(
                400,
                f"The model '{model}' is served by route {route.name!r} ({route.kind}), which "
                f"does not serve /v1/{family}; only openai and azure routes do.",
                type="invalid_request_error",
                param="model",
                code="unsupported_route_kind",
            )
        if route is not None:
            if not route.allows_passthrough(family):
                raise _family_off(family, route)
            return route
    if owner_route is not None:
        route = table.by_name.get(owner_route)
        if route is not None and route.allows_passthrough(family):
            return route
    for route in table.routes:
        if route.allows_passthrough(family):
            return route
    if any(r.kind in PASSTHROUGH_KINDS for r in table.routes):
        raise _family_off(family)
    raise GatewayError(
        404, f"No OpenAI-compatible route serves /v1/{family}.", code="no_passthrough_route"
    )


def _family_off(family: str, route: Route | None = None) -> GatewayError:
    if route is not None and route.kind == "azure" and family not in AZURE_FAMILIES:
        return GatewayError(
            404,
            f"/v1/{family} is not served by Azure OpenAI (route {route.name!r}); Azure serves "
            f"{', '.join(sorted(AZURE_FAMILIES))}.",
            code="unknown_url",
        )
    return GatewayError(
        404, f"/v1/{family} is not enabled on this gateway's routes.", code="unknown_url"
    )


@dataclass(frozen=True)
class Passthrough:
    """What a passthrough exchange uses of the running gateway."""

    settings: Settings
    objects: Ownership
    upstreams: Upstreams
    telemetry: Telemetry


@dataclass
class ReadyBody:
    """A JSON body that a door (`responses_api`) already read, checked and rewrote, and what
    reads the answer for it (telemetry, policy headers) and is told how it ended."""

    data: bytes
    body: dict
    observer: DoorObserver


class DoorObserver(AnswerObserver, Protocol):
    def finish(self, status: int) -> None: ...


class Exchange:
    """One passthrough request, as a raw ASGI response so that the status line, the upstream
    connection and the client's departure are all in its hands."""

    def __init__(
        self,
        admitted: AdmittedRequest,
        parts: Passthrough,
        ready: ReadyBody | None = None,
    ) -> None:
        self.admitted = admitted
        self.request = admitted.request
        self.parts = parts
        self.ready = ready
        self.settings = parts.settings
        self.relay: Relay | None = None
        self.upload_error: BaseException | None = None
        self.watch: ClientWatch | None = None
        self.anthropic = False  # an Anthropic client's request: answered in Anthropic's shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = self.admitted.arrival
        self.watch = watch = ClientWatch()
        tenant, family, status = self.admitted.tenant, "invalid", 500
        try:
            path = parse_target(
                scope.get("raw_path") or scope["path"].encode(), scope.get("query_string", b"")
            )
            family = path.family
            self.anthropic = self.ready is None and from_anthropic_client(self.request, path)
            status = await self._exchange(tenant, path, scope["method"], receive, send)
        except asyncio.CancelledError:
            if not watch.absorbed():
                raise
            status = 499
        except _ClientGone:
            status = 499
        except GatewayError as exc:
            status = exc.status
            if self.relay is None or not self.relay.started:
                await self._error_response(exc)(scope, receive, send)
        finally:
            watch.stop()
            if self.ready is not None:
                self.ready.observer.finish(status)
            else:
                self._observe(tenant, family, status, time.perf_counter() - arrival)

    def _error_response(self, exc: GatewayError) -> Response:
        if not self.anthropic:
            return exc.to_response()
        return Response(anthropic_error(exc), exc.status, media_type="application/json")

    def _observe(self, tenant: str, family: str, status: int, seconds: float) -> None:
        telemetry = self.parts.telemetry
        if telemetry.enabled:
            try:
                telemetry.metrics.observe_passthrough(tenant, family, status, seconds)
            except Exception:
                log.debug("passthrough metrics failed", exc_info=True)

    # -- the client's side ---------------------------------------------------------------

    def _watch_disconnect(self, receive: Receive) -> None:
        """From here on, a client that leaves cancels the exchange (closing the upstream)."""
        if self.watch is not None:
            self.watch.start(self.request.scope, receive)

    async def _upload(self, receive: Receive, limit: int) -> AsyncIterator[bytes]:
        """The client's body streamed to the upstream as it arrives, within `limit` bytes."""
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.upload_error = _ClientGone()
                raise self.upload_error
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                self.upload_error = _too_large(limit, "FIRSTTOKEN_MAX_UPLOAD_BYTES")
                raise self.upload_error
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                break
        self._watch_disconnect(receive)

    async def _read_request(self, path: PassPath, receive: Receive) -> tuple[Any, Any, str | None]:
        """(data for aiohttp, the parsed JSON body or None, the content type to forward).

        A body is JSON unless it is an upload; in tenant mode uploads are accepted only where
        the API takes them, so that every other body can be checked for object references."""
        headers = self.request.headers
        content_type = headers.get("content-type")
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise GatewayError(400, "Content-Length must be a number.", code="invalid_request")
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if media in UPLOAD_TYPES:
            if self.parts.objects.enabled and not path.takes_upload:
                raise GatewayError(
                    415,
                    f"{path.display()} takes a JSON body.",
                    type="invalid_request_error",
                    code="unsupported_media_type",
                )
            limit = self.settings.max_upload_bytes
            if declared is not None and int(declared) > limit:
                raise _too_large(limit, "FIRSTTOKEN_MAX_UPLOAD_BYTES")
            return self._upload(receive, limit), None, content_type
        raw = await read_body(self.request, self.settings.max_body_bytes)
        self._watch_disconnect(receive)
        if not raw:
            return None, None, None
        parsed = parse_json(raw, self.settings.max_json_depth, self.settings.max_json_containers)
        if strip_reserved(parsed):  # only the gateway's pd router tells a server where KV is
            raw = orjson.dumps(parsed)
        return raw, parsed, content_type or "application/json"

    # -- the exchange --------------------------------------------------------------------

    async def _exchange(
        self, tenant: str, path: PassPath, method: str, receive: Receive, send: Send
    ) -> int:
        if method not in METHODS:
            raise GatewayError(
                405,
                f"Method {method} is not allowed on {path.display()}.",
                type="invalid_request_error",
                code="method_not_allowed",
            )
        content_type: str | None
        if self.ready is not None:
            data, body, content_type = self.ready.data, self.ready.body, "application/json"
            self._watch_disconnect(receive)
        else:
            data, body, content_type = await self._read_request(path, receive)
        objects, upstreams = self.parts.objects, self.parts.upstreams
        owner_route = await objects.check_request(tenant, path, method, body)
        anthropic = self.anthropic
        if anthropic:
            route = choose_anthropic_route(upstreams.table, owner_route)
        elif self.ready is not None:  # admitted and routed by its door
            route = self.admitted.route
            if not route.allows_passthrough(path.family):
                raise _family_off(path.family, route)
        else:
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or len(model) > self.settings.max_model_chars:
                model = None
            route = choose_route(upstreams.table, path.family, model, owner_route)
        await upstreams.ready(route.name)
        upstream = upstreams[route.name]
        headers = forward_headers(
            self.request, ANTHROPIC_FORWARD_HEADERS if anthropic else FORWARD_HEADERS
        )
        if content_type is not None:
            headers["content-type"] = content_type
            declared = self.request.headers.get("content-length")
            if declared is not None and not isinstance(data, bytes):
                headers["content-length"] = declared  # a streamed upload keeps its length
        observer = self.ready.observer if self.ready is not None else None
        self.relay = relay = Relay(
            send, self.settings, objects, tenant, path, method, route, observer
        )
        if anthropic:
            relay.own_error, relay.upstream_error = anthropic_error, anthropic_error_from_upstream
        timeout = route.timeout_s or self.settings.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._forward(upstream, method, path, headers, data)
        except TimeoutError:
            if relay.streaming_events:  # an event stream ends with an error event
                await relay.error_event("The upstream stream timed out.", "timeout_error")
                await relay.end()
            if relay.started:  # a download is cut: the client sees a truncated body
                return 504
            raise GatewayError(
                504,
                f"Upstream {route.name!r} did not answer within {timeout}s.",
                code="upstream_timeout",
            ) from None

    async def _forward(
        self,
        upstream: Upstream,
        method: str,
        path: PassPath,
        headers: dict[str, str],
        data: Any,
    ) -> int:
        try:
            resp = await upstream.forward(method, path, headers, data)
        except UpstreamError as exc:
            if self.upload_error is not None:
                raise self.upload_error from None
            raise GatewayError(exc.status, exc.message, code="upstream_unreachable") from None
        assert self.relay is not None
        return await relay_answer(resp, self.relay.answer)


def _too_large(limit: int, variable: str) -> GatewayError:
    return GatewayError(
        413,
        f"Request body exceeds the limit of {limit} bytes ({variable}).",
        code="request_too_large",
    )
