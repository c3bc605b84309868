"""The HTTP/1.1 client of generation requests: keep-alive POSTs whose answers stream.

Every chat, completion and Messages request a remote route sends goes out here, and so do the
periodic `/metrics` reads of a replicated route (small GETs, several a second on a fleet); every
other request (passthrough, model lists, Bedrock's signed calls) stays on aiohttp.
It exists for speed. aiohttp's client is general (cookies, redirects, proxies, multipart bodies,
tracing, per-request timers): a bare relay through it spends a quarter to a half more CPU per
streamed answer, and adds about 0.35 ms more to the first token at concurrency 1, than one
through a connection that parses with httptools (llhttp, the parser uvicorn reads requests
with) and hands the reader each read as it is (`bench/gateway_overhead.py` runs both floors).

What it does not do is as deliberate as what it does:

- one origin per pool, the route's: no redirects (a 3xx is an answer like any other), no
  proxies, no cookies;
- an answer's head is bounded (`MAX_HEAD_BYTES`, `MAX_HEADERS`); its body is read as the reader
  takes it, the socket paused while more than `HIGH_WATER` bytes wait;
- no compression: a request asks for `identity`, and an answer encoded anyway is refused;
- a connection goes back to the pool only once its answer was read to the end and both sides
  keep it alive (a released answer's last bytes are drained in the background, within
  `DRAIN_BYTES` and `DRAIN_S`);
- a reused connection that closes before any byte of the answer (the server dropped it as the
  request left) is retried once on a new one.

A reader may also `divert` an answer: from then on each read's body bytes go to its function
from the connection's read callback, instead of waking a reader task per read (an event stream
relays most of its events this way, `gateway.pipeline.stream_relay`); the reader then waits
once, for the end (`diverted_end`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import socket
import ssl
import time
import weakref
from collections.abc import Callable, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
HIGH_WATER = 256 * 1024  # answer bytes waiting for the reader past which reading pauses
IDLE_TIMEOUT_S = 60.0  # an idle connection older than this is closed, not reused
# A released answer whose last bytes are still on their way is read to its end in the
# background, within these bounds, so that its connection is reused: an event stream stops
# at `[DONE]`, and the chunked body's terminator often arrives just after it.
DRAIN_BYTES = 64 * 1024
DRAIN_S = 1.0
_DEFAULT_PORTS = {"http": 80, "https": 443}
_FORBIDDEN_IN_HEADERS = ("\r", "\n", "\0")
_SET_BY_CLIENT = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class AnswerBroken(ConnectionError):
    """The connection ended, or the answer broke HTTP, before the answer was whole."""


class _Stop(Exception):
    """Raised from a parser callback to stop parsing: the answer broke a limit or the protocol."""


class Origin:
    """Where a pool's connections go: scheme, host and port of the route's base URL."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {base_url!r}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or _DEFAULT_PORTS[parts.scheme]
        shown = f"[{self.host}]" if ":" in self.host else self.host
        default = self.port == _DEFAULT_PORTS[parts.scheme]
        self.host_header = shown if default else f"{shown}:{self.port}"
        # Credentials in the base URL (`http://user:pass@host/v1`), sent as aiohttp sends them:
        # Basic auth, unless the request has its own Authorization.
        self.basic_auth: str | None = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.basic_auth = "Basic " + base64.b64encode(pair.encode("latin-1")).decode()
        base_url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.base_url = base_url.rstrip("/")

    @functools.cached_property
    def tls(self) -> ssl.SSLContext | None:
        """The system's trust store and hostname checks, made on first use (it reads the CA
        files)."""
        return ssl.create_default_context() if self.scheme == "https" else None

    def target(self, path: str) -> str:
        """The request target for `path` after the base URL, encoded as aiohttp would send it."""
        return _target(self.base_url, self.scheme, self.host, self.port, path)


@functools.lru_cache(maxsize=1024)
def _target(base_url: str, scheme: str, host: str, port: int, path: str) -> str:
    url = URL(base_url + path)
    if (url.scheme, url.host, url.port) != (scheme, host, port):
        raise ValueError(f"{path!r} leaves the route's origin")
    return url.raw_path_qs


def request_head(
    origin: Origin,
    target: str,
    headers: Mapping[str, str],
    length: int | None,
    method: str = "POST",
) -> bytes:
    """A request's head; `length` None for a request without a body (a GET). Like aiohttp:
    UTF-8, `Accept: */*` unless given, and a value or name with a line break refused (it would
    inject headers)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host_header}"]
    accept = authorization = False
    for name, value in headers.items():
        if any(c in name or c in value for c in _FORBIDDEN_IN_HEADERS):
            raise ValueError(f"header {name!r} has a line break or NUL: refused")
        lowered = name.lower()
        if lowered in _SET_BY_CLIENT:
            continue
        accept = accept or lowered == "accept"
        authorization = authorization or lowered == "authorization"
        lines.append(f"{name}: {value}")
    if not accept:
        lines.append("Accept: */*")
    if origin.basic_auth is not None and not authorization:
        lines.append(f"Authorization: {origin.basic_auth}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


class Http1Pool:
    """Keep-alive connections to one origin, at most `size` in use at once."""

    def __init__(self, base_url: str, *, size: int = 256, connect_timeout_s: float = 10.0) -> None:
        self.origin = Origin(base_url)
        self.connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Connection] = []  # last in, first out: the warmest first
        self._open: set[_Connection] = set()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return sum(1 for conn in self._idle if not conn.closed)

    async def post(self, path: str, headers: Mapping[str, str], body: bytes) -> Http1Response:
        """Send `body` to `path` (after the base URL) and wait for the answer's head. OSError
        (AnswerBroken, a refused or timed-out connect) when no answer came."""
        origin = self.origin
        return await self._send(request_head(origin, origin.target(path), headers, len(body)), body)

    async def get(self, path: str, headers: Mapping[str, str]) -> Http1Response:
        """A GET of `path` (after the base URL), as `post` sends a body."""
        origin = self.origin
        return await self._send(request_head(origin, origin.target(path), headers, None, "GET"))

    async def _send(self, head: bytes, body: bytes = b"") -> Http1Response:
        await self._slots.acquire()
        try:
            for attempt in (1, 2):
                conn, reused = await self._connection()
                answer = Http1Response(conn, self._slots)
                conn.send(head, body, answer)
                try:
                    await answer.wait_head()
                except BaseException as exc:
                    answer.discard()
                    retry = isinstance(exc, AnswerBroken) and reused and not answer.received_any
                    if retry and attempt == 1:
                        continue  # the server dropped an idle connection as the request left
                    raise
                return answer  # it gives the slot back when it is done
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            self._slots.release()
            raise

    async def warm(self, connections: int, timeout_s: float) -> None:
        """Open up to `connections` idle connections within `timeout_s`, so that the first
        requests pay no TCP or TLS handshake; failures are the first request's to see."""
        missing = connections - len(self._idle)
        if missing <= 0:
            return
        try:
            async with asyncio.timeout(timeout_s):
                opened = await asyncio.gather(
                    *(self._connect() for _ in range(missing)), return_exceptions=True
                )
        except TimeoutError:
            return
        for conn in opened:
            if isinstance(conn, _Connection):
                self._park(conn)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    async def _connection(self) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TIMEOUT_S:
                return conn, True
            conn.close()
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        origin = self.origin
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Connection(self),
                origin.host,
                origin.port,
                ssl=origin.tls,
                server_hostname=origin.host if origin.tls is not None else None,
            )
        return conn

    def _park(self, conn: _Connection) -> None:
        """A connection whose answer is over, ready for the next request."""
        if conn.closed:
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _opened(self, conn: _Connection) -> None:
        self._open.add(conn)

    def _closed(self, conn: _Connection) -> None:
        self._open.discard(conn)


class _Connection(asyncio.Protocol):
    """One connection; it feeds what it reads to the answer it is carrying."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        # Weak: an answer its reader dropped without release() is collected, and gives its
        # slot back (Http1Response.__del__).
        self._answer: weakref.ref[Http1Response] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._pool._opened(self)

    def send(self, head: bytes, body: bytes, answer: Http1Response) -> None:
        assert self.transport is not None
        self._answer = weakref.ref(answer)
        self.transport.writelines((head, body))

    def data_received(self, data: bytes) -> None:
        answer = self._answer() if self._answer is not None else None
        if answer is None:  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        answer.feed(data)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._closed(self)
        answer = self._answer() if self._answer is not None else None
        if answer is not None:
            answer.lost()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def finished(self, answer: Http1Response, keep_alive: bool) -> None:
        """`answer` was read to its end (or given up): park the connection or close it."""
        if self._answer is not None and self._answer() is answer:
            self._answer = None
        if keep_alive and not self.closed:
            self._pool._park(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class Http1Response:
    """An answer as it arrives: the few members of aiohttp's `ClientResponse` that the upstream
    kinds read (`status`, `headers`, `raw_headers`, `content_type`, `content_length`,
    `content.iter_any()`, `release()`, `close()`, `closed`)."""

    def __init__(self, conn: _Connection, slots: asyncio.Semaphore) -> None:
        self._conn = conn
        self._slots = slots
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self._raw: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_done = False
        self._interim = False  # a 1xx head, skipped
        self._chunked = False
        self._keep_alive = False
        self._length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: AnswerBroken | None = None
        self._done = False  # the slot is given back and the connection parked or closed
        self._draining = False
        self._drained = 0
        self._drain_timer: asyncio.TimerHandle | None = None
        self.received_any = False
        # A diverted answer's body goes to `_sink` as it is read; True from it: nothing more
        # is wanted (`_sink_over`), and a failure in it ends the answer as a reader's would.
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_over = False
        self._sink_failure: Exception | None = None

    # what the upstream kinds read ------------------------------------------------------------

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return tuple(self._raw)

    @functools.cached_property
    def headers(self) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(
            CIMultiDict(
                (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
                for name, value in self._raw
            )
        )

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower-cased (as aiohttp gives it)."""
        for name, value in self._raw:
            if name.lower() == b"content-type":
                media = value.split(b";", 1)[0].strip().lower()
                return media.decode("latin-1") or "application/octet-stream"
        return "application/octet-stream"

    @property
    def content_length(self) -> int | None:
        return self._length

    @property
    def content(self) -> Http1Response:
        """aiohttp's `resp.content.iter_any()` reads here as `resp.iter_any()`."""
        return self

    @property
    def closed(self) -> bool:
        return self._done or self._draining

    def iter_any(self) -> Http1Response:
        """Each read's body bytes as they arrive (whatever waited, joined); AnswerBroken if the
        answer ends before it is whole. The answer is its own iterator, not an async generator:
        a reader that stops at `[DONE]` drops it, where a generator left suspended would be
        handed to the event loop to finalize (a wake-up and a task per answer)."""
        return self

    def __aiter__(self) -> Http1Response:
        return self

    async def __anext__(self) -> bytes:
        chunks = self._chunks
        while True:
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._complete:
                self._finish(keep_alive=self._keep_alive)
                raise StopAsyncIteration
            await self._wait()

    def release(self) -> None:
        """Done with the answer: its connection is reused once the answer has ended. What is
        still on its way (an event stream's reader stops at `[DONE]`, the body's terminator
        follows) is read and dropped in the background, within DRAIN_BYTES and DRAIN_S;
        past either, or on any failure, the connection is closed instead."""
        if self._done or self._draining:
            return
        if self._complete or self._error is not None or not self._head_done:
            self._finish(keep_alive=self._reusable())
            return
        self._draining = True
        self._drained = self._buffered
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume_reading()
        self._drain_timer = asyncio.get_running_loop().call_later(DRAIN_S, self._finish, False)
        self._drain_step()

    def close(self) -> None:
        """Done with the answer at once: the upstream sees the connection drop, unless the
        answer had already ended whole (then the connection is reused, as aiohttp does)."""
        self._finish(keep_alive=self._reusable() and not self._draining)

    def discard(self) -> None:
        """Give up the connection of an answer that never came (the caller keeps the slot)."""
        if not self._done:
            self._done = True
            self._conn.finished(self, keep_alive=False)

    # a diverted answer -------------------------------------------------------------------------

    def divert(self, sink: Callable[[bytes], bool]) -> None:
        """From now on, each read's body bytes go to `sink`, called from the connection's read
        callback, instead of waiting for `__anext__` (which must not be called again): no task
        wakes up per read. What arrived and was not read yet goes to `sink` at once. `sink`
        returns True when it wants nothing more (the rest is left for `release` to drain); it
        must not raise, but an exception from it ends the answer for its reader like a broken
        one (`diverted_end` raises it)."""
        self._sink = sink
        if self._paused:  # paused for a reader that had not come back: the sink reads now
            self._paused = False
            self._conn.resume_reading()
        if self._chunks and not self._done:
            self._deliver()

    def pause(self) -> None:
        """Stop reading a diverted answer's connection (its reader's own client is slow)."""
        if not self._paused and not self._done:
            self._paused = True
            self._conn.pause_reading()

    def resume(self) -> None:
        if self._paused and not self._done:
            self._paused = False
            self._conn.resume_reading()

    async def diverted_end(self) -> bool:
        """Wait for a diverted answer to end: True when its sink wanted nothing more, False when
        the body ended whole; raises `AnswerBroken` (or the sink's exception) when it broke."""
        while not (self._sink_over or self._complete or self._error is not None):
            await self._wait()
        if self._sink_failure is not None:
            raise self._sink_failure
        if self._sink_over:
            return True
        if self._error is not None:
            raise self._error
        return False

    def undivert(self) -> None:
        """The reader is done with the diverted answer: nothing more goes to its sink."""
        self._sink = None

    def _deliver(self) -> None:
        sink = self._sink
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if sink is None or self._sink_over:
            return
        try:
            over = sink(data)
        except Exception as exc:  # noqa: BLE001  # the reader's failure, raised where it waits
            self._sink_failure = exc
            over = True
        if over:
            self._sink_over = True

    # what the connection tells ---------------------------------------------------------------

    async def wait_head(self) -> None:
        while True:
            if self._error is not None:
                raise self._error
            if self._head_done:
                return
            await self._wait()

    def feed(self, data: bytes) -> None:
        self.received_any = True
        try:
            if self._head_done:
                self._parser.feed_data(data)
            else:
                self._feed_head(data)
        except _Stop as exc:
            self._fail(str(exc))
        except httptools.HttpParserUpgrade:
            self._fail("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Stop):
                if not self._complete:
                    self._fail(str(cause))
                else:  # more than one answer: the connection is not reused
                    self._conn.close()
            else:
                self._fail(f"the upstream's answer is not valid HTTP ({type(exc).__name__})")
        if self._draining:
            self._drain_step()
            return
        if self._sink is not None:
            if self._chunks:
                self._deliver()
            if self._sink_over or self._complete or self._error is not None:
                self._wake()  # the one wake-up of a diverted answer: its end
            return
        if self._buffered > HIGH_WATER and not self._paused and not self._complete:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def _feed_head(self, data: bytes) -> None:
        room = MAX_HEAD_BYTES - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            self._parser.feed_data(data)
            return
        self._head_bytes = MAX_HEAD_BYTES
        self._parser.feed_data(memoryview(data)[:room])
        if not self._head_done:
            raise _Stop(f"the upstream's answer head is over {MAX_HEAD_BYTES} bytes")
        self._parser.feed_data(memoryview(data)[room:])

    def lost(self) -> None:
        if not self._complete and self._error is None:
            if self._head_done and self._length is None and not self._chunked:
                self._complete = True  # an answer without a length ends with its connection
            else:
                self._error = AnswerBroken("the upstream closed the connection mid-answer")
        if self._draining:
            self._finish(keep_alive=False)
        self._wake()

    def _drain_step(self) -> None:
        self._drained += self._buffered
        self._chunks.clear()
        self._buffered = 0
        if self._error is not None or self._drained > DRAIN_BYTES:
            self._finish(keep_alive=False)
        elif self._complete:
            self._finish(keep_alive=self._keep_alive)

    # parser callbacks --------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise _Stop("the upstream sent more than one answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self._raw) >= MAX_HEADERS:
            raise _Stop(f"the upstream's answer has more than {MAX_HEADERS} header fields")
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (103 Early Hints): the real one follows
            self._interim = True
            self._raw = []
            return
        for name, value in self._raw:
            lowered = name.lower()
            if lowered == b"content-length":
                self._length = _length(value)
            elif lowered == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif lowered == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                raise _Stop("the upstream compressed its answer although asked for identity")
        self.status = status
        self._head_done = True
        # Read now: llhttp forgets the answer's framing once the answer is complete.
        self._keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self._complete:
            return
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True

    # ------------------------------------------------------------------------------------------

    def _reusable(self) -> bool:
        return self._complete and self._error is None and not self._chunks and self._keep_alive

    def _finish(self, keep_alive: bool) -> None:
        if self._done:
            return
        self._done = True
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._chunks.clear()
        if self._paused:  # a connection goes back to the pool reading
            self._paused = False
            self._conn.resume_reading()
        self._conn.finished(self, keep_alive)
        self._slots.release()

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = AnswerBroken(message)
        self._conn.close()

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __del__(self) -> None:
        # An answer dropped without release() or close() must not keep its slot forever.
        if not self._done:
            self._done = True
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001  # a loop already closed: nothing left to close
                pass
            self._slots.release()


def _length(value: bytes) -> int | None:
    try:
        length = int(value)
    except ValueError:
        return None
    return length if length >= 0 else None


__all__ = ["AnswerBroken", "Http1Pool", "Http1Response", "Origin", "request_head"]
