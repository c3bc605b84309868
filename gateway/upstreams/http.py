"""The HTTP side of every remote upstream kind: one pooled session to the route's origin.

`openai` (and `azure`) and `anthropic` routes differ in request shape and auth headers, not
in how they talk HTTP, so each holds an `UpstreamHttp` rather than inheriting from the other.
Everything an upstream sends back is untrusted: redirects are never followed (the route's key
and the tenant's prompt go to the route's origin only), bodies are read within byte limits,
and an answer in the wrong media type is an upstream error.

Generation requests (`post`) go through `Http1Pool`, a keep-alive HTTP/1.1 client made for
exactly that (`gateway.upstreams.http1`, which says why), and so do the `/metrics` reads of a
replicated route, on a pool of their own at the origin (at most `ORIGIN_READS` connections: a
server that stops answering them ties up two connections, never the generation requests'
slots); everything else (passthrough, model lists, signed Bedrock calls) through aiohttp's
session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.errors import ERROR_BODY_BYTES
from gateway.paths import PassPath, upstream_url
from gateway.sse import DEFAULT_MAX_EVENT_BYTES
from gateway.upstreams.base import (
    UpstreamError,
    UpstreamResponse,
    relayed_headers,
    retry_after_seconds,
)
from gateway.upstreams.http1 import Http1Pool

log = logging.getLogger("firsttoken.upstream")

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
WARM_UP_READ_BYTES = 1024 * 1024
WARM_UP_TIMEOUT_S = 5.0  # a route's start waits no longer for its warm connections
MODELS_TTL_S = 60.0
MODELS_TIMEOUT_S = 2.0
# An upstream's model list is untrusted like any answer: bounded in bytes, entries and id length.
MODELS_MAX_BYTES = 4 * 1024 * 1024
MODELS_MAX_ENTRIES = 1000
MODEL_ID_MAX_CHARS = 256
ORIGIN_READS = 2  # connections for reads at the origin (`/metrics`), apart from the requests'


class ResponseTooLarge(Exception):
    """An upstream body past the byte limit; the connection has been closed."""


def make_session(pool_size: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    """The route's pooled client. It keeps no cookies: one session serves every tenant, and a
    cookie an upstream set on one tenant's answer (Cloudflare's, on OpenAI's API) would go out
    with every other tenant's requests to that origin."""
    connector = aiohttp.TCPConnector(limit=pool_size, keepalive_timeout=60, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=True,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class UpstreamHttp:
    """Requests to one route's origin with its auth headers, and nothing else."""

    def __init__(
        self,
        route: Route,
        auth_headers: Mapping[str, str],
        *,
        pool_size: int = 256,
        connect_timeout_s: float = 10.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.route = route
        self.base_url = (route.base_url or "").rstrip("/")
        self.max_response_bytes = max_response_bytes
        self._auth = {**route.headers, **auth_headers}
        self._pool_size = pool_size
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._posts: Http1Pool | None = None
        self._origin_reads: Http1Pool | None = None
        self._models: tuple[float, list[dict[str, Any]]] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise UpstreamError(f"route {self.route.name!r} is not started", status=503)
        return self._session

    @property
    def posts(self) -> Http1Pool:
        if self._posts is None:
            raise UpstreamError(f"route {self.route.name!r} is not started", status=503)
        return self._posts

    async def start(self) -> None:
        if self._session is None:
            self._session = make_session(self._pool_size, self._connect_timeout_s)
            self._posts = Http1Pool(
                self.base_url, size=self._pool_size, connect_timeout_s=self._connect_timeout_s
            )
            parts = urlsplit(self.base_url)
            self._origin_reads = Http1Pool(
                f"{parts.scheme}://{parts.netloc}",
                size=ORIGIN_READS,
                connect_timeout_s=self._connect_timeout_s,
            )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._posts is not None:
            await self._posts.aclose()
            self._posts = None
        if self._origin_reads is not None:
            await self._origin_reads.aclose()
            self._origin_reads = None

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A JSON request's headers. `identity`: a compressed event stream would sit in the
        decompressor between events."""
        headers = {"content-type": "application/json", "accept-encoding": "identity", **self._auth}
        if extra:
            headers.update(extra)
        return headers

    async def post(
        self, path: str, payload: bytes, extra: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        """POST JSON (a generation request); any status from 300 up is raised as an
        `UpstreamError`."""
        try:
            resp: UpstreamResponse = await self.posts.post(path, self.headers(extra), payload)
        except OSError as exc:
            raise UpstreamError(
                f"upstream {self.route.name!r} unreachable ({type(exc).__name__})", status=503
            ) from None
        if resp.status >= 300:
            raise await self.status_error(resp)
        return resp

    async def forward(
        self,
        method: str,
        path: PassPath,
        headers: Mapping[str, str],
        data: Any,
        *,
        client_chosen: tuple[str, ...] = (),
    ) -> aiohttp.ClientResponse:
        """A passthrough request as the client sent it (allow-listed headers, its own content
        type), to a URL built from the route's base and the validated path. The route's
        headers override the client's, except the protocol headers named in `client_chosen`
        (a version, never a credential) that the client did send."""
        out = {
            "accept-encoding": "identity",
            **headers,
            **self._auth,
        }  # auth last: never the client's
        out.update((name, headers[name]) for name in client_chosen if name in headers)
        try:
            return await self.session.request(
                method,
                upstream_url(self.base_url, path),
                data=data,
                headers=out,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(
                f"Upstream {self.route.name!r} unreachable ({type(exc).__name__}).", status=503
            ) from None

    async def get_json(self, path: str, timeout_s: float, limit: int) -> Any:
        """A small GET (model list, warm-up): the parsed body, or None on any failure."""
        try:
            async with self.session.get(
                self.base_url + path,
                headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
            ) as resp:
                body = await read_limited(resp, limit)
                return orjson.loads(body) if resp.status == 200 else None
        except (
            aiohttp.ClientError,
            OSError,
            TimeoutError,
            orjson.JSONDecodeError,
            ResponseTooLarge,
            UpstreamError,
        ) as exc:
            log.info("GET %s on route %s failed: %s", path, self.route.name, type(exc).__name__)
            return None

    async def get_origin_text(self, path: str, timeout_s: float, limit: int) -> str | None:
        """A small GET of `path` at the route's origin (scheme, host and port of its base URL:
        a server's `/metrics` sits beside `/v1`, never elsewhere); None on any failure."""
        parts = urlsplit(self.base_url)
        try:
            async with self.session.get(
                f"{parts.scheme}://{parts.netloc}{path}",
                headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
            ) as resp:
                body = await read_limited(resp, limit)
                return body.decode("utf-8", "replace") if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ResponseTooLarge, UpstreamError) as exc:
            log.info("GET %s on route %s failed: %s", path, self.route.name, type(exc).__name__)
            return None

    async def read_origin_text(self, path: str, timeout_s: float, limit: int) -> str | None:
        """What `get_origin_text` reads, on the pool of origin reads: for a read made several
        times a second (a replica's `/metrics`), where aiohttp's client was most of an idle
        gateway's CPU (5.3 ms a second against 3.9 with this pool, four replicas every 0.5 s)."""
        reads = self._origin_reads
        if reads is None:
            return None
        resp = None
        try:
            async with asyncio.timeout(timeout_s):
                resp = await reads.get(path, self.headers())
                body = await read_limited(resp, limit)
            return body.decode("utf-8", "replace") if resp.status == 200 else None
        except (OSError, TimeoutError, ValueError, ResponseTooLarge) as exc:
            log.info("GET %s on route %s failed: %s", path, self.route.name, type(exc).__name__)
            return None
        finally:
            if resp is not None:
                resp.close()

    async def model_list(self) -> list[dict[str, Any]]:
        """The objects of the upstream's `GET /models` with a string `id` of at most
        MODEL_ID_MAX_CHARS, the first MODELS_MAX_ENTRIES of them, cached for MODELS_TTL_S; an
        upstream that does not answer in time lists nothing until then."""
        now = time.monotonic()
        if self._models is not None and now - self._models[0] < MODELS_TTL_S:
            return self._models[1]
        listing = await self.get_json("/models", MODELS_TIMEOUT_S, MODELS_MAX_BYTES)
        items = listing.get("data") if isinstance(listing, dict) else None
        models = [
            item
            for item in (items if isinstance(items, list) else ())
            if isinstance(item, dict)
            and isinstance(item.get("id"), str)
            and 0 < len(item["id"]) <= MODEL_ID_MAX_CHARS
        ][:MODELS_MAX_ENTRIES]
        self._models = (now, models)
        return models

    async def warm_up(self, connections: int, path: str = "/models") -> None:
        """Open keep-alive connections now so the first request pays no TCP/TLS handshake (a
        cold pool is slower, not broken: failures are only logged): the generation requests'
        own, and aiohttp's with a small GET."""
        await asyncio.gather(
            self.posts.warm(connections, WARM_UP_TIMEOUT_S),
            *(
                self.get_json(path, WARM_UP_TIMEOUT_S, WARM_UP_READ_BYTES)
                for _ in range(connections)
            ),
        )

    async def status_error(self, resp: UpstreamResponse) -> UpstreamError:
        name, status = self.route.name, resp.status
        if status < 400:
            # A redirect would carry the route's key and the prompt to wherever it points;
            # the same request would be redirected again, so it is not retried either.
            resp.close()
            return UpstreamError(
                f"upstream {name!r} answered {status}, a redirect, which the gateway does not "
                "follow",
                status=status,
                retryable=False,
            )
        headers = relayed_headers(resp.raw_headers, retry=True)
        retry_after = retry_after_seconds(resp.headers.get("retry-after"))
        content_type = resp.headers.get("content-type", "application/json")
        try:
            body: bytes | None = await read_prefix(resp, ERROR_BODY_BYTES)
        except (aiohttp.ClientError, OSError):
            body = None  # the client gets a 502 of ours instead
        return UpstreamError(
            f"upstream {name!r} answered {status}",
            status=status,
            retryable=status >= 500 or status == 429,
            body=body,
            content_type=content_type,
            retry_after=retry_after,
            headers=headers,
        )

    def expect(self, resp: UpstreamResponse, stream: bool) -> None:
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

    async def read_body(self, resp: UpstreamResponse) -> bytes:
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


class RemoteUpstream:
    """What the remote kinds share: the route, its `UpstreamHttp`, and the limits and warm-up
    of their answers. Each kind adds its own auth headers, paths and shapes."""

    def __init__(
        self,
        route: Route,
        auth_headers: Mapping[str, str],
        *,
        pool_size: int = 256,
        connect_timeout_s: float = 10.0,
        warm_connections: int = 2,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.route = route
        self.http = UpstreamHttp(
            route,
            auth_headers,
            pool_size=pool_size,
            connect_timeout_s=connect_timeout_s,
            max_response_bytes=max_response_bytes,
        )
        self.max_event_bytes = max_event_bytes
        self._warm_connections = warm_connections

    async def start(self) -> None:
        await self.http.start()

    async def warm_up(self) -> None:
        await self.http.warm_up(self._warm_connections)

    async def aclose(self) -> None:
        await self.http.aclose()


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


async def read_limited(resp: UpstreamResponse, limit: int) -> bytes:
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


async def read_prefix(resp: UpstreamResponse, limit: int) -> bytes:
    """At most the first `limit` bytes of the body (an error's: its message is at the start);
    the rest is never read, the connection is closed instead."""
    chunks, size = [], 0
    try:
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                resp.close()
                break
    finally:
        resp.release()
    return b"".join(chunks)[:limit]


__all__ = [
    "ResponseTooLarge",
    "UpstreamHttp",
    "UpstreamResponse",
    "json_object_body",
    "read_limited",
    "read_prefix",
]
