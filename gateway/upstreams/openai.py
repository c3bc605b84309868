"""The `openai` upstream kind: any OpenAI-compatible server, over a pooled aiohttp client.

aiohttp's client is on the hot path because it measured fastest for streaming pass-through
(see README, "Why aiohttp"). Event bytes go to the client exactly as received.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import aiohttp
import orjson

from gateway.routes import Route
from gateway.sse import SSEParser
from gateway.upstreams.base import (CallContext, Completed, OutEvent, UpstreamError,
                                    retry_after_seconds, usage_from_chunk)

log = logging.getLogger("firsttoken.upstream")

ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
MODELS_TTL_S = 60.0


def make_session(pool_size: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=pool_size, keepalive_timeout=60, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True,
                                 skip_auto_headers=("User-Agent",))


class OpenAIUpstream:
    def __init__(self, route: Route, *, api_key: str | None, pool_size: int = 256,
                 connect_timeout_s: float = 10.0, warm_connections: int = 2) -> None:
        self.route = route
        self.base_url = (route.base_url or "").rstrip("/")
        self._api_key = api_key
        self._pool_size = pool_size
        self._connect_timeout_s = connect_timeout_s
        self._warm_connections = warm_connections
        self.session: aiohttp.ClientSession | None = None
        self.warm = False
        self._models: tuple[float, list[dict]] | None = None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # identity: a compressed event stream would sit in the decompressor between events.
        headers = {"content-type": "application/json", "accept-encoding": "identity",
                   **self.route.headers}
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
                async with self.session.get(self.base_url + "/models", headers=self.headers(),
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    await resp.read()
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
            async with self.session.get(self.base_url + "/models", headers=self.headers(),
                                        timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    cards = [self.card(item) for item in
                             (orjson.loads(await resp.read()).get("data") or [])
                             if isinstance(item, dict) and isinstance(item.get("id"), str)]
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, orjson.JSONDecodeError,
                AttributeError):
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
            resp = await self.session.post(self.base_url + path, data=payload,
                                           headers=self.headers(ctx.forward_headers))
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise UpstreamError(f"upstream {self.route.name!r} unreachable ({type(exc).__name__})",
                                status=503) from None
        if resp.status >= 400:
            body = await resp.read()
            retry_after = retry_after_seconds(resp.headers.get("retry-after"))
            content_type = resp.headers.get("content-type", "application/json")
            resp.release()
            retryable = resp.status >= 500 or resp.status == 429
            raise UpstreamError(f"upstream {self.route.name!r} answered {resp.status}",
                                status=resp.status, retryable=retryable, body=body,
                                content_type=content_type, retry_after=retry_after)
        return resp

    async def open_stream(self, body: dict, ctx: CallContext) -> "OpenAIEventStream":
        resp = await self._post(ENDPOINT_PATHS[ctx.endpoint], orjson.dumps(body), ctx)
        return OpenAIEventStream(resp)

    async def complete(self, body: dict, ctx: CallContext) -> Completed:
        resp = await self._post(ENDPOINT_PATHS[ctx.endpoint], orjson.dumps(body), ctx)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        usage = None
        try:
            parsed = orjson.loads(raw)
            if isinstance(parsed, dict):
                usage = usage_from_chunk(parsed)
        except orjson.JSONDecodeError:
            pass
        return Completed(resp.status, raw, resp.headers.get("content-type", "application/json"), usage)


class OpenAIEventStream:
    """Upstream SSE bytes -> `OutEvent`s, one list per network read."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._parser = SSEParser()

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        parser = self._parser
        async for chunk in self._resp.content.iter_any():
            events = parser.feed(chunk)
            if events:
                yield [OutEvent.unread(e.raw, e.data) for e in events]
        tail = parser.flush()
        if tail:
            yield [OutEvent.unread(e.raw, e.data) for e in tail]

    async def aclose(self) -> None:
        # close(), not release(): a half-read stream must not go back to the pool, and the
        # upstream must see the connection drop at once.
        if not self._resp.closed:
            self._resp.close()

