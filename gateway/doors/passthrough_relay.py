"""The upstream's answer to a passthrough request, relayed to the client within limits.

The upstream is not trusted: a redirect is a 502 (never followed), a 5xx becomes the
gateway's own 502/503 (keeping `Retry-After`), only allow-listed headers reach the client,
JSON bodies are read up to FIRSTTOKEN_MAX_RESPONSE_BYTES (else a clean 502), downloads are
streamed and cut past FIRSTTOKEN_MAX_UPLOAD_BYTES, and an SSE stream is relayed byte for byte
with each event bounded by FIRSTTOKEN_MAX_EVENT_BYTES (past it: an `error` event, then the
end). In tenant mode a JSON answer from an object family goes through `Ownership.after_response`
(records, list filtering), and a streamed create has its new ids recorded before the client
sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson
from starlette.types import Send

from gateway.boundary.ownership import Ownership
from gateway.config.routes import Route
from gateway.config.settings import Settings
from gateway.errors import (
    ERROR_BODY_BYTES,
    GatewayError,
    error_body,
    openai_error_from_upstream,
)
from gateway.paths import PassPath
from gateway.sse import SSE_HEADERS, SSEEvent, read_events
from gateway.upstreams.http import read_prefix

log = logging.getLogger("firsttoken.passthrough")

RESPONSE_HEADERS = frozenset(
    {
        "content-type",
        "content-disposition",
        "retry-after",
        "x-request-id",
        "openai-processing-ms",
        "openai-version",
    }
)
RESPONSE_HEADER_PREFIXES = ("x-ratelimit-",)
CREATED_EVENTS_SCANNED = 4  # a create's first event names what it created


T = TypeVar("T")


async def relay_answer(
    resp: aiohttp.ClientResponse, answer: Callable[[aiohttp.ClientResponse], Awaitable[T]]
) -> T:
    """`answer(resp)`, then the connection back to the pool only if the body was read to its
    end: never half-read, and the upstream sees a client that left at once (closed)."""
    try:
        return await answer(resp)
    finally:
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()


class AnswerObserver(Protocol):
    """What a door that owns a passthrough request reads of its answer, as it goes out."""

    async def headers(self) -> dict[str, str]: ...
    def whole(self, raw: bytes) -> None: ...
    def events(self, events: list[SSEEvent], arrived: float) -> None: ...


def response_headers(upstream: Any) -> dict[str, str]:
    """The upstream headers a client may see (never cookies or the account's identity)."""
    return {
        k.lower(): v
        for k, v in upstream.items()
        if k.lower() in RESPONSE_HEADERS or k.lower().startswith(RESPONSE_HEADER_PREFIXES)
    }


class Relay:
    """Writes one upstream answer to the client; `started` once the status line went out."""

    def __init__(
        self,
        send: Send,
        settings: Settings,
        objects: Ownership,
        tenant: str,
        path: PassPath,
        method: str,
        route: Route,
        observer: AnswerObserver | None = None,
    ) -> None:
        self.send = send
        self.observer = observer
        self.settings = settings
        self.objects = objects
        self.tenant = tenant
        self.path = path
        self.method = method
        self.route = route
        # How an error reads: OpenAI's shape, unless the door names another (Anthropic's
        # Files API answers in Anthropic's).
        self.own_error: Callable[[GatewayError], bytes] = lambda exc: orjson.dumps(exc.to_dict())
        self.upstream_error: Callable[[int, bytes | None], bytes] = openai_error_from_upstream
        self.started = False
        self.streaming_events = False

    async def answer(self, resp: aiohttp.ClientResponse) -> int:
        """Relay `resp`; returns the status the client got (or 502 if a body was cut)."""
        status, name = resp.status, self.route.name
        if 300 <= status < 400:
            raise GatewayError(
                502,
                f"Upstream {name!r} answered with a redirect ({status}); "
                "redirects are never followed.",
                code="upstream_redirect",
            )
        headers = response_headers(resp.headers)
        if status >= 500 or status < 200:
            mine = 503 if status == 503 else 502
            error = GatewayError(
                mine, f"Upstream {name!r} answered {status}.", code=f"upstream_{status}"
            )
            retry = {"retry-after": headers["retry-after"]} if "retry-after" in headers else {}
            await self.whole(
                mine, {"content-type": "application/json", **retry}, self.own_error(error)
            )
            return mine
        if status >= 400:  # the upstream's own refusal, bounded and in OpenAI's shape
            raw = self.upstream_error(status, await read_prefix(resp, ERROR_BODY_BYTES))
            await self.whole(status, {**headers, "content-type": "application/json"}, raw)
            return status
        content_type = resp.headers.get("content-type", "")
        if status < 300 and "text/event-stream" in content_type:
            return await self.events(resp, headers)
        download = self.path.segments[-1] == "content"
        if status >= 300 or (is_json(content_type) and not download):
            raw = await read_bounded(resp, self.settings.max_response_bytes, name)
            if status < 300 and self.objects.enabled and self.path.collection is not None:
                raw = await self._owned(raw)
            if status < 300 and self.observer is not None:
                self.observer.whole(raw)
            await self.whole(status, headers, raw)
            return status
        return await self.download(resp, status, headers, self.settings.max_upload_bytes)

    async def _owned(self, raw: bytes) -> bytes:
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise GatewayError(
                502,
                f"Upstream {self.route.name!r} sent a body that is not valid JSON.",
                code="upstream_invalid_json",
            ) from None
        changed = await self.objects.after_response(
            self.tenant, self.path, self.method, self.route.name, payload
        )
        return raw if changed is payload else orjson.dumps(changed)

    async def start(self, status: int, headers: dict[str, str]) -> None:
        if self.observer is not None:
            headers = {**await self.observer.headers(), **headers}  # the upstream's id wins
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await self.send({"type": "http.response.start", "status": status, "headers": raw})
        self.started = True

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        await self.start(status, {**headers, "content-length": str(len(body))})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def download(
        self, resp: aiohttp.ClientResponse, status: int, headers: dict[str, str], limit: int
    ) -> int:
        """A body streamed as it arrives; past `limit` the connection is cut, so the client
        sees a truncated body, never a short one that looks complete."""
        if resp.content_length is not None and resp.content_length > limit:
            raise GatewayError(
                502,
                f"The upstream body exceeds {limit} bytes (FIRSTTOKEN_MAX_UPLOAD_BYTES).",
                code="upstream_too_large",
            )
        await self.start(status, headers)
        size = 0
        try:
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > limit:
                    log.warning("passthrough download cut at %d bytes", limit)
                    return 502
                await self.write(chunk)
        except aiohttp.ClientError as exc:
            log.warning("passthrough download failed: %s", type(exc).__name__)
            return 502
        await self.end()
        return status

    async def events(self, resp: aiohttp.ClientResponse, headers: dict[str, str]) -> int:
        """An SSE stream, whole events as they complete (line ends normalised), each bounded.
        A create's first events are held until the ids they name are recorded as the tenant's."""
        await self.start(200, {**headers, **SSE_HEADERS})
        self.streaming_events = True
        limit = self.settings.max_event_bytes
        watch = self.objects.enabled and self.method == "POST" and self.path.collection is not None
        # Only whole events go out: a cut in the middle of one would leave the client a partial
        # event with our error event glued to it.
        scanned = 0
        held: list[bytes] = []  # raw events kept back until a create's ids are recorded
        observer = self.observer
        observed: list[SSEEvent] = []  # events read since the observer last saw some
        status = 200
        reads = read_events(resp.content.iter_any(), limit)
        try:
            async for read in reads:
                events = read.events
                if observer is not None:
                    observed.extend(events)
                if watch:
                    for event in events:
                        scanned += 1
                        created = created_ids(event.event, event.data)
                        if created:
                            await self.objects.record(
                                self.tenant, self.path.family, self.route.name, created
                            )
                        watch = watch and not created and scanned < CREATED_EVENTS_SCANNED
                    held.extend(event.raw for event in events)
                    if watch and not (read.too_big or read.last):
                        continue
                    out, held = b"".join(held), []
                else:
                    out = b"".join(event.raw for event in events)
                if out:
                    await self.write(out)
                    if observer is not None:
                        observer.events(observed, read.arrived)
                        observed = []
                if read.too_big:
                    status = 502
                    await self.error_event(
                        f"An upstream event exceeded {limit} bytes (FIRSTTOKEN_MAX_EVENT_BYTES)."
                    )
        except GatewayError as exc:
            await self.error_event(exc.message, exc.type)
            status = exc.status
        except (aiohttp.ClientError, ValueError) as exc:
            await self.error_event(f"The upstream stream failed ({type(exc).__name__}).")
            status = 502
        finally:
            await reads.aclose()  # a write that failed left it suspended
        await self.end()
        return status

    async def error_event(self, message: str, type: str = "upstream_error") -> None:
        """An in-stream error as the OpenAI SDK reads it (`event: error`, `data.error`)."""
        event = {"type": "error", **error_body(message, type)}
        await self.write(b"event: error\ndata: " + orjson.dumps(event) + b"\n\n")


def created_ids(name: str | None, data: bytes | None) -> list[str]:
    """The ids a create's first SSE event names: a Responses `response.created` (its
    `response.id`), an Assistants `thread.created` (`id`) or `thread.run.created`
    (`thread_id`, the thread that `/v1/threads/runs` made)."""
    if not data or (b"created" not in data and "created" not in (name or "")):
        return []
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(event, dict):
        return []
    kind = event.get("type") or name
    if kind == "response.created" and isinstance(event.get("response"), dict):
        found = event["response"].get("id")
    elif name == "thread.created":
        found = event.get("id")
    elif name == "thread.run.created":
        found = event.get("thread_id")
    else:
        return []
    return [found] if isinstance(found, str) else []


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, name: str) -> bytes:
    too_large = GatewayError(
        502,
        f"Upstream {name!r} sent a body over {limit} bytes (FIRSTTOKEN_MAX_RESPONSE_BYTES).",
        code="upstream_too_large",
    )
    if resp.content_length is not None and resp.content_length > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except aiohttp.ClientError as exc:
        raise GatewayError(
            502, f"Upstream {name!r} body failed ({type(exc).__name__}).", code="upstream_error"
        ) from None
    return b"".join(chunks)
