"""An `anthropic` route's answer to a Messages API request, relayed in Anthropic's own shapes.

The upstream is not trusted: a redirect is a 502 (never followed), a 5xx becomes the gateway's
own error, only the rate-limit and request-id headers reach the client (`relayed_headers`), a
JSON body is read within FIRSTTOKEN_MAX_RESPONSE_BYTES, and an event stream is relayed whole
event by whole event as each completes, each bounded by FIRSTTOKEN_MAX_EVENT_BYTES, up to its
`message_stop` or `error` event and nothing after it. On the way the relay reads what telemetry
needs (content deltas, usage) without holding anything back.

Every error on this door has Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`), as a response before the status line went out and as an `event: error` after.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable

import aiohttp
import orjson
from starlette.types import Send

from gateway.boundary.request_id import REQUEST_ID_HEADER
from gateway.config.settings import Settings
from gateway.doors.passthrough_relay import is_json, read_bounded
from gateway.errors import ERROR_BODY_BYTES, GatewayError, upstream_error_parts
from gateway.pipeline.prepare import NativeBody
from gateway.sse import SSE_RAW_HEADERS, SSEEvent, event_name, read_events
from gateway.telemetry.record import RequestRecord
from gateway.translation.anthropic import openai_usage
from gateway.translation.messages_chat import anthropic_error_type
from gateway.upstreams.base import has_request_id, relayed_headers
from gateway.upstreams.http import read_prefix

# Events after which nothing more is read: the end of the answer, or its failure.
FINAL_EVENTS = frozenset({"message_stop", "error"})
USAGE_EVENTS = frozenset({"message_start", "message_delta"})


def error_body(message: str, type: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type, "message": message}})


def anthropic_error_from_upstream(status: int, body: bytes | None) -> bytes:
    """An upstream's error body in Anthropic's shape, its message kept; one already in that
    shape (`type` "error", an `error` with string `type` and `message`) goes as it came."""
    parts = upstream_error_parts(status, body, anthropic_error_type(status))
    if body and len(body) < ERROR_BODY_BYTES:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("type") == "error":
            inner = parsed.get("error")
            if isinstance(inner, dict) and all(
                isinstance(inner.get(k), str) for k in ("type", "message")
            ):
                return body
    out = {"type": "error", "error": {"type": parts["type"], "message": parts["message"]}}
    return orjson.dumps(out)


def error_event(message: str, type: str = "api_error") -> bytes:
    """An in-stream failure as Anthropic sends one (the SDK raises it from the stream)."""
    return b"event: error\ndata: " + error_body(message, type) + b"\n\n"


async def send_whole(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """A whole JSON answer in two ASGI messages."""
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send,
    exc: GatewayError,
    request_id: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A gateway error on this door, with its status and message, in Anthropic's shape; it
    names the gateway's request id unless `headers` (the upstream's) carry one."""
    own = [(REQUEST_ID_HEADER, request_id.encode())]
    body = error_body(exc.message, anthropic_error_type(exc.status))
    await send_whole(send, exc.status, headers or own, body)


def answer_headers(
    raw_headers: tuple[tuple[bytes, bytes], ...], request_id: str, retry: bool = False
) -> list[tuple[bytes, bytes]]:
    """The upstream's rate-limit and request-id headers (its `request-id` as `x-request-id`,
    and as `request-id` too, the name the Anthropic SDK reads), else the gateway's own id."""
    relayed = relayed_headers(raw_headers, retry=retry) or []
    if not has_request_id(relayed):
        relayed.append((REQUEST_ID_HEADER, request_id.encode()))
    ids = [value for name, value in relayed if name == REQUEST_ID_HEADER]
    return [*relayed, (b"request-id", ids[0])]


class MessagesRelay:
    """Writes one upstream answer to the client; `started` once the status line went out,
    `streaming` once an event stream did (a failure is then an `error` event)."""

    def __init__(
        self,
        send: Send,
        record: RequestRecord,
        request_id: str,
        route: str,
        settings: Settings,
        prepared: NativeBody,
    ) -> None:
        self.send = send
        self.prepared = prepared
        self.record = record
        self.request_id = request_id
        self.route = route
        self.settings = settings
        self.started = False
        self.streaming = False
        self.ended = False
        self._usage: dict = {}  # Anthropic's usage fields as they arrive, latest value wins

    # -- writing ---------------------------------------------------------------------------

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, tail: bytes = b"") -> None:
        if not self.ended:
            self.ended = True
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})

    async def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.started = self.ended = True
        await send_whole(self.send, status, headers, body)

    async def error(
        self, exc: GatewayError, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """A failure of ours: a whole Anthropic error before the status line (with `headers`,
        else the gateway's request id), else an error event that ends the stream."""
        if not self.started:
            self.started = self.ended = True
            await send_error(self.send, exc, self.request_id, headers)
        elif self.streaming and not self.ended:
            await self.end(error_event(exc.message, anthropic_error_type(exc.status)))

    # -- the answer ------------------------------------------------------------------------

    async def answer(self, resp: aiohttp.ClientResponse, stream: bool) -> None:
        """Relay `resp`: a redirect or 5xx as the gateway's error, a 4xx as the upstream sent
        it, a 2xx as a bounded JSON body or an event stream."""
        status, name = resp.status, self.route
        if 300 <= status < 400:
            raise GatewayError(
                502,
                f"Upstream {name!r} answered with a redirect ({status}); "
                "redirects are never followed.",
            )
        if status >= 500 or status < 200:
            mine = status if status in (503, 529) else 502
            self.record.status = "upstream_error"
            headers = answer_headers(resp.raw_headers, self.request_id, retry=True)
            await self.error(GatewayError(mine, f"Upstream {name!r} answered {status}."), headers)
            return
        media = resp.content_type
        if status >= 400:  # the upstream's own refusal, bounded and in Anthropic's shape
            self.record.ended_with(status)
            body = anthropic_error_from_upstream(status, await read_prefix(resp, ERROR_BODY_BYTES))
            headers = answer_headers(resp.raw_headers, self.request_id, retry=True)
            await self.whole(status, [*headers, *await self._policy_headers()], body)
        elif stream:
            if media != "text/event-stream":
                raise GatewayError(
                    502, f"Upstream {name!r} answered {media[:64]!r} where an event stream was due."
                )
            await self._events(resp)
        else:
            if not is_json(media):
                raise GatewayError(
                    502, f"Upstream {name!r} answered {media[:64]!r} where JSON was due."
                )
            await self._json(resp, status, retry=False)

    async def _json(self, resp: aiohttp.ClientResponse, status: int, retry: bool) -> None:
        raw = await read_bounded(resp, self.settings.max_response_bytes, self.route)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise GatewayError(
                502, f"Upstream {self.route!r} answered with a body that is not a JSON object."
            )
        if status < 300 and "usage" in parsed:
            self.record.usage = openai_usage(parsed["usage"])
        headers = answer_headers(resp.raw_headers, self.request_id, retry=retry)
        await self.whole(status, [*headers, *await self._policy_headers()], raw)

    async def _policy_headers(self) -> list[tuple[bytes, bytes]]:
        headers = await self.prepared.headers()
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def _events(self, resp: aiohttp.ClientResponse) -> None:
        await self.events(resp.raw_headers, resp.content.iter_any())

    async def events(
        self, raw_headers: tuple[tuple[bytes, bytes], ...], body: AsyncIterable[bytes]
    ) -> None:
        """Whole events as they complete, each write the moment its read came in. `body`: the
        upstream's SSE bytes (a `bedrock` route's are re-framed from AWS event-stream)."""
        headers = answer_headers(raw_headers, self.request_id)
        await self.start(200, [*SSE_RAW_HEADERS, *headers, *await self._policy_headers()])
        self.streaming = True
        limit = self.settings.max_event_bytes
        reads = read_events(body, limit)
        try:
            async for read in reads:
                if await self._forward(read.events, read.arrived):
                    return
                if read.too_big:
                    self.record.status = "upstream_error"
                    await self.end(
                        error_event(
                            f"An upstream event exceeded {limit} bytes "
                            "(FIRSTTOKEN_MAX_EVENT_BYTES)."
                        )
                    )
                    return
        except aiohttp.ClientError as exc:
            self.record.status = "upstream_error"
            await self.end(error_event(f"The upstream stream failed ({type(exc).__name__})."))
            return
        finally:
            await reads.aclose()  # the reads stop at message_stop, before the body's end
        self.record.status = "upstream_error"
        await self.end(error_event("The upstream stream ended before message_stop."))

    async def _forward(self, events: list[SSEEvent], arrived: float) -> bool:
        """Write these events at once, then read them for telemetry; True once the stream is
        over (`message_stop` or an `error` event went out, and the response with it)."""
        if not events:
            return False
        content = final = False
        cut = len(events)
        for i, event in enumerate(events):
            name = event_name(event)
            if name == "content_block_delta":
                content = True
            elif name in USAGE_EVENTS:
                self._note_usage(name, event.data)
            elif name in FINAL_EVENTS:
                final, cut = True, i + 1
                if name == "error":
                    self.record.status = "upstream_error"
                break
        out = b"".join(event.raw for event in events[:cut])
        if final:
            await self.end(out)
        else:
            await self.write(out)
        if content:
            self.record.content_arrived(arrived, time.perf_counter())
        return final

    def _note_usage(self, name: str, data: bytes | None) -> None:
        """Anthropic sends input and cache counts in `message_start` and the output count
        (sometimes updated input counts) in `message_delta`; telemetry gets OpenAI's shape."""
        try:
            payload = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            return
        if not isinstance(payload, dict):
            return
        holder = payload.get("message") if name == "message_start" else payload
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if not isinstance(usage, dict):
            return
        self._usage.update((k, v) for k, v in usage.items() if v is not None)
        self.record.usage = openai_usage(self._usage)
