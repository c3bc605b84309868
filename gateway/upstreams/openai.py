"""The `openai` upstream kind: any OpenAI-compatible server, over a pooled aiohttp client.

aiohttp's client is on the hot path because it measured fastest for streaming pass-through
(see README, "Why aiohttp"). Event bytes go to the client exactly as received.

What comes back is untrusted: redirects are never followed (the route's key and the tenant's
prompt go to the route's origin only), bodies and events are read within byte limits, and an
answer in the wrong shape (HTML for a stream, non-JSON for a completion) is an upstream error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson

from gateway.errors import sse_error_event
from gateway.routes import Route
from gateway.sse import DEFAULT_MAX_EVENT_BYTES, DONE_DATA, EventTooLarge, SSEEvent, SSEParser
from gateway.upstreams.base import (
    CallContext,
    Completed,
    OutEvent,
    UpstreamError,
    encode_body,
    relayed_headers,
    retry_after_seconds,
    usage_from_chunk,
)

log = logging.getLogger("firsttoken.upstream")

ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
MODELS_TTL_S = 60.0
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
WARM_UP_READ_BYTES = 1024 * 1024


class ResponseTooLarge(Exception):
    """An upstream body past the byte limit; the connection has been closed."""


def make_session(pool_size: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=pool_size, keepalive_timeout=60, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=True,
        skip_auto_headers=("User-Agent",),
    )


class OpenAIUpstream:
    def __init__(
        self,
        route: Route,
        *,
        api_key: str | None,
        pool_size: int = 256,
        connect_timeout_s: float = 10.0,
        warm_connections: int = 2,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.route = route
        self.base_url = (route.base_url or "").rstrip("/")
        self._api_key = api_key
        self._pool_size = pool_size
        self._connect_timeout_s = connect_timeout_s
        self._warm_connections = warm_connections
        self.max_event_bytes = max_event_bytes
        self.max_response_bytes = max_response_bytes
        self.session: aiohttp.ClientSession | None = None
        self.warm = False
        self._models: tuple[float, list[dict]] | None = None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # identity: a compressed event stream would sit in the decompressor between events.
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            **self.route.headers,
        }
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        if extra:
            headers.update(extra)
        return headers

    async def start(self) -> None:
        if self.session is None:
            self.session = make_session(self._pool_size, self._connect_timeout_s)

    async def warm_up(self) -> None:
        """Open keep-alive connections now so the first request pays no TCP/TLS handshake."""

        async def one() -> None:
            try:
                async with self.session.get(
                    self.base_url + "/models",
                    headers=self.headers(),
                    timeout=aiohttp.ClientTimeout(total=5),
                    allow_redirects=False,
                ) as resp:
                    await read_limited(resp, WARM_UP_READ_BYTES)
            except Exception as exc:  # a cold pool is slower, not broken
                log.info("warm-up of route %s failed: %s", self.route.name, type(exc).__name__)

        await asyncio.gather(*(one() for _ in range(self._warm_connections)))
        self.warm = True

    async def model_cards(self) -> list[dict]:
        """The upstream's model list in OpenAI's card shape, cached for MODELS_TTL_S."""
        now = time.monotonic()
        if self._models is not None and now - self._models[0] < MODELS_TTL_S:
            return self._models[1]
        cards: list[dict] = []
        try:
            async with self.session.get(
                self.base_url + "/models",
                headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=2),
                allow_redirects=False,
            ) as resp:
                if resp.status == 200:
                    listing = orjson.loads(await read_limited(resp, self.max_response_bytes))
                    items = listing.get("data") if isinstance(listing, dict) else None
                    cards = [
                        self.card(item)
                        for item in (items if isinstance(items, list) else ())
                        if isinstance(item, dict) and isinstance(item.get("id"), str)
                    ]
        except (
            TimeoutError,
            aiohttp.ClientError,
            OSError,
            orjson.JSONDecodeError,
            ResponseTooLarge,
        ):
            log.info("model list of route %s unavailable", self.route.name)
        self._models = (now, cards)
        return cards

    def card(self, item: dict) -> dict:
        return {"object": "model", "owned_by": self.route.name, **item}

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _post(self, path: str, payload: bytes, ctx: CallContext) -> aiohttp.ClientResponse:
        try:
            resp = await self.session.post(
                self.base_url + path,
                data=payload,
                headers=self.headers(ctx.forward_headers),
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError(
                f"upstream {self.route.name!r} unreachable ({type(exc).__name__})", status=503
            ) from None
        if resp.status >= 300:
            raise await self._status_error(resp)
        return resp

    async def _status_error(self, resp: aiohttp.ClientResponse) -> UpstreamError:
        name, status = self.route.name, resp.status
        if status < 400:
            # A redirect would carry the route's key and the prompt to wherever it points;
            # the same request would be redirected again, so it is not retried either.
            resp.close()
            return UpstreamError(
                f"upstream {name!r} answered {status}, a redirect, which the "
                "gateway does not follow",
                status=status,
                retryable=False,
            )
        headers = relayed_headers(resp.raw_headers, retry=True)
        retry_after = retry_after_seconds(resp.headers.get("retry-after"))
        content_type = resp.headers.get("content-type", "application/json")
        try:
            body: bytes | None = await read_limited(resp, self.max_response_bytes)
        except ResponseTooLarge:
            body = None  # not relayed: the client gets a 502 of ours instead
        finally:
            resp.release()
        retryable = status >= 500 or status == 429
        return UpstreamError(
            f"upstream {name!r} answered {status}",
            status=status,
            retryable=retryable,
            body=body,
            content_type=content_type,
            retry_after=retry_after,
            headers=headers,
        )

    def _expect(self, resp: aiohttp.ClientResponse, stream: bool) -> None:
        """A stream must come as text/event-stream and a completion as JSON; anything else (an
        HTML page from a proxy in between, a server that ignored `stream`) is an upstream
        failure, retried like a 5xx: the client has seen nothing yet."""
        media = resp.content_type
        if stream:
            if media == "text/event-stream":
                return
        elif media == "application/json" or media.endswith("+json"):
            return
        resp.close()
        wanted = "text/event-stream" if stream else "JSON"
        raise UpstreamError(
            f"upstream {self.route.name!r} answered {media[:64]!r} where {wanted} was expected",
            status=502,
        )

    async def read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await read_limited(resp, self.max_response_bytes)
        except ResponseTooLarge:
            raise UpstreamError(
                f"upstream {self.route.name!r} sent a response over "
                f"{self.max_response_bytes} bytes",
                status=502,
                retryable=False,
            ) from None
        finally:
            resp.release()

    async def open_stream(self, body: dict, ctx: CallContext) -> OpenAIEventStream:
        resp = await self._post(ENDPOINT_PATHS[ctx.endpoint], encode_body(body), ctx)
        self._expect(resp, stream=True)
        return OpenAIEventStream(resp, self.max_event_bytes, self.route.name)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        resp = await self._post(ENDPOINT_PATHS[ctx.endpoint], encode_body(body), ctx)
        self._expect(resp, stream=False)
        raw = await self.read_body(resp)
        parsed = json_object_body(raw, self.route.name)
        return Completed(
            resp.status,
            raw,
            resp.headers.get("content-type", "application/json"),
            usage_from_chunk(parsed),
            relayed_headers(resp.raw_headers),
        )


def json_object_body(raw: bytes, route_name: str) -> dict:
    """A non-streaming answer must be one JSON object; anything else (an HTML error page, a
    bare string) is the upstream breaking its protocol: a 502, never relayed as a 200."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise UpstreamError(
            f"upstream {route_name!r} answered with a body that is not a JSON object", status=502
        )
    return parsed


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or ResponseTooLarge (connection closed) once it passes `limit` bytes.
    Counted as it arrives, after decompression, whatever Content-Length says."""
    length = resp.content_length
    if length is not None and length > limit:
        resp.close()
        raise ResponseTooLarge
    chunks = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            resp.close()
            raise ResponseTooLarge
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class OpenAIEventStream:
    """Upstream SSE bytes -> `OutEvent`s, one list per network read.

    It stops reading at `[DONE]`; an event whose data is not a JSON object becomes an error
    event and ends the stream, as does an event past `max_event_bytes`."""

    def __init__(
        self,
        resp: aiohttp.ClientResponse,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        route: str = "upstream",
    ) -> None:
        self._resp = resp
        self._parser = SSEParser(max_event_bytes)
        self._route = route
        self.relayed = relayed_headers(resp.raw_headers)

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        parser = self._parser
        async for chunk in self._resp.content.iter_any():
            try:
                events = parser.feed(chunk)
            except EventTooLarge as exc:
                if exc.events:
                    out = self._out(exc.events)
                    yield out
                    if out[-1].done or out[-1].error:
                        return
                raise UpstreamError(
                    f"upstream {self._route!r} sent an event over {exc.limit} bytes",
                    status=502,
                    retryable=False,
                ) from None
            if events:
                out = self._out(events)
                yield out
                if out[-1].done or out[-1].error:
                    return
        tail = parser.flush()
        if tail:
            yield self._out(tail)

    def _out(self, events: list[SSEEvent]) -> list[OutEvent]:
        """Events as the client gets them, cut after `[DONE]` or a malformed event. Only the
        first byte of each payload is looked at here; the full parse comes after the write."""
        out = []
        for e in events:
            data = e.data
            if data is not None and data[:1] != b"{":
                stripped = data.strip()
                if stripped == DONE_DATA:
                    out.append(OutEvent(e.raw, done=True))
                    return out
                if not stripped.startswith(b"{"):
                    out.append(
                        OutEvent(
                            sse_error_event(
                                f"upstream {self._route!r} sent an event that is not JSON"
                            ),
                            error=True,
                        )
                    )
                    return out
            out.append(OutEvent.unread(e.raw, data))
        return out

    async def aclose(self) -> None:
        # close(), not release(): a half-read stream must not go back to the pool, and the
        # upstream must see the connection drop at once.
        if not self._resp.closed:
            self._resp.close()
