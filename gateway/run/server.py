"""The HTTP server in front of the app: uvicorn's httptools protocol, with limits on the head.

uvicorn sets no limit on the request line or the headers, and httptools joins the pieces of a
long header value with `bytes +=`, so one unauthenticated 64 MB header costs quadratic time on
the event loop and stalls every other client. `FrontDoorProtocol` counts head bytes as they
arrive and never feeds the parser more of a head than the limit allows: past it, the client gets
one OpenAI-shaped error (414 or 431) and the connection is closed. uvicorn's own plain-text 400
for a malformed request becomes the same JSON shape.

`server_config` is the one place that builds the uvicorn `Config`, for the CLI and the tests
alike, so both run with the same limits. `QuietServer` is uvicorn's server ticking once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.boundary.client_watch import DISCONNECT_EXTENSION
from gateway.boundary.direct_body import DIRECT_BODY_EXTENSION
from gateway.config.settings import Settings
from gateway.errors import error_body

# After an error response the server stops writing but keeps reading (and dropping) what the
# client is still sending for this long, so the client reads the error instead of a reset.
LINGER_S = 2.0
_VERSION_BYTES = len(b" HTTP/1.1\r\n")
_LINE_SLACK = 64  # more than any method name, its space and the version
SERVER_TICK_S = 1.0


@dataclass(frozen=True)
class ClientLimits:
    """Caps on one request head (request line and header fields), on the requests one
    connection may have waiting for their answers, and on how long a client may take to send a
    request; see `Settings`."""

    max_request_line_bytes: int = 8 * 1024
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_pipelined_requests: int = 64
    head_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientLimits:
        return cls(
            settings.max_request_line_bytes,
            settings.max_header_bytes,
            settings.max_headers,
            settings.max_pipelined_requests,
            settings.client_head_timeout_s,
            settings.client_body_timeout_s,
            settings.max_connections or default_max_connections(),
        )


# Open files the process keeps for itself beyond connections (logs, pipes, the engine's files).
_RESERVED_FILES = 64
_MAX_OPEN_FILES = 1 << 20


def raise_open_file_limit() -> None:
    """Raise the soft open-file limit to the hard one, as Go's runtime does at start-up: a
    soft limit of 1,024 (many systems' default) would cap a gateway at a few hundred streams."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = _MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _MAX_OPEN_FILES)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def default_max_connections() -> int:
    """Half the open files the process may have: a client's stream may need one upstream
    connection beside its own, and the gateway must still reach its upstreams when clients
    hold every connection they may."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = _MAX_OPEN_FILES
    return max(1, (soft - _RESERVED_FILES) // 2)


_HEAD = "head"
_BODY = "body"


class _Rejected(Exception):
    """Raised from a parser callback: the head breaks a limit (carried out of httptools as the
    context of its `HttpParserCallbackError`)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head limits and JSON errors.

    `data_received` feeds a head to the parser at most up to `max_header_bytes`; a head that has
    not ended by then is refused without parsing the rest. Parser callbacks check the request
    line (`on_url`, called for every piece of the target) and count header fields exactly.
    A pipelined head that starts in the same read as the previous request's end is counted from
    the next read: it may pass the byte limit by that one read (at most 256 KiB), which costs
    linear time only, and its field count is exact regardless. At most `max_pipelined_requests`
    requests of one connection wait for their answers: a head past that is refused (429) once
    the answers before it are out, and the connection closes.

    uvicorn times out only the idle wait between requests, so a client that sends half a head
    (or half a body) and then nothing held its connection, and the memory of what it sent,
    forever: a few thousand such connections exhaust the process's file descriptors. Here a new
    connection must begin its head within `head_timeout_s`, a head must arrive whole within
    `head_timeout_s` of its first byte, and a body may pause at most `body_timeout_s` between
    two reads (not while the server itself holds the body back: reading paused, or a
    `100 Continue` not sent yet). Past either, the client gets a 408 (a connection that sent
    nothing is just closed). One timer per connection watches this, re-armed when it fires, so
    a request costs only the clock reads.
    Past `max_connections` held at once, a new connection gets a 503 and is closed: the process
    keeps the open files it needs to reach its upstreams.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ClientLimits = ClientLimits(),
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._head_bytes: int | None = 0  # bytes of the current head fed so far; None in a body
        self._heads_done = 0
        self._fields = 0
        self._rejected = False
        self._deferred: tuple[int, str, str] | None = None
        # Requests not yet answered and their disconnect, oldest first (pipelined requests are
        # answered in order, so answered ones leave from the left: one read may hold thousands)
        self._open: deque[tuple[Any, asyncio.Future]] = deque()
        # What the server waits for from the client (_HEAD, _BODY or None) and since when
        self._waiting: str | None = None
        self._since = 0.0
        self._clock: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._rejected = True
            self._answer(
                503,
                f"The gateway holds as many client connections as it may "
                f"({self.limits.max_connections}, FIRSTTOKEN_MAX_CONNECTIONS); try again.",
                "too_many_connections",
                kind="service_unavailable",
                linger=False,
            )
            return
        self._waiting, self._since = _HEAD, self.loop.time()
        self._arm_clock(self._since + self.limits.head_timeout_s)

    # bytes in -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._waiting is _BODY:
            self._since = self.loop.time()
        if self._rejected:  # lingering after an error: drop what the client still sends
            return
        limit = self.limits.max_header_bytes
        view: bytes | memoryview = data
        while True:
            head = self._head_bytes
            if head is None or len(view) <= limit - head:
                if head is not None:
                    self._head_bytes = head + len(view)
                self._feed(view)
                return
            # More than the head may still use: feed only that much. The head must end within
            # it, or it is too large and the rest is never parsed.
            room = limit - head
            done = self._heads_done
            self._head_bytes = limit
            if not self._feed(memoryview(view)[:room]):
                return
            if self._heads_done == done:
                self._reject(
                    431,
                    f"The request head exceeds {limit} bytes (FIRSTTOKEN_MAX_HEADER_BYTES).",
                    "request_header_fields_too_large",
                )
                return
            view = memoryview(view)[room:]

    def _feed(self, data: bytes | memoryview) -> bool:
        """Feed the parser; False when the rest of this read must not be parsed (an error was
        answered, or an upgrade request ended HTTP parsing, as in uvicorn)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Rejected):
                self._reject(cause.status, cause.message, cause.code)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self._reject(400, "Invalid HTTP request received.", "invalid_http_request")
            return False
        return True

    # parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._waiting, self._since = _HEAD, self.loop.time()

    def on_url(self, url: bytes) -> None:
        # Called for each piece of the target; uvicorn joins them in self.url.
        target = len(self.url) + len(url)
        limit = self.limits.max_request_line_bytes
        if target + _LINE_SLACK > limit and (
            target + len(self.parser.get_method()) + 1 + _VERSION_BYTES > limit
        ):
            raise _Rejected(
                414,
                f"The request line exceeds {limit} bytes (FIRSTTOKEN_MAX_REQUEST_LINE_BYTES).",
                "uri_too_long",
            )
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's own, plus the count; inline, as this runs for every header of every request.
        self._fields += 1
        if self._fields > self.limits.max_headers:
            raise _Rejected(
                431,
                f"The request has more than {self.limits.max_headers} header "
                "fields (FIRSTTOKEN_MAX_HEADERS).",
                "request_header_fields_too_large",
            )
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._heads_done += 1
        self._waiting, self._since = _BODY, self.loop.time()
        open_requests = self._open
        while open_requests and open_requests[0][0].response_complete:
            open_requests.popleft()
        if len(open_requests) >= self.limits.max_pipelined_requests:
            # Each parsed request holds a few KB until answered, and one read may hold
            # thousands: past the cap the rest of the connection is refused, after the
            # answers it is owed.
            raise _Rejected(
                429,
                f"More than {self.limits.max_pipelined_requests} pipelined requests wait on "
                "one connection (FIRSTTOKEN_MAX_PIPELINED_REQUESTS).",
                "too_many_pipelined_requests",
            )
        # The request's disconnect, as a future (see gateway.boundary.client_watch).
        gone = self.loop.create_future()
        extensions: dict[str, dict[object, object]] = dict(self.scope.get("extensions") or {})
        extensions[DISCONNECT_EXTENSION] = {"future": gone}
        self.scope["extensions"] = extensions
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:
            open_requests.append((self.cycle, gone))
            # The request's task has not run yet: the writer is in its scope before it looks.
            extensions[DIRECT_BODY_EXTENSION] = {"writer": CycleBody(self.cycle)}

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None
        # Every request of this connection still being answered has lost its client (uvicorn
        # tells only the newest of pipelined requests).
        for cycle, gone in self._open:
            if not cycle.response_complete and not gone.done():
                gone.set_result(None)
        self._open.clear()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._waiting = None
        # What follows on this connection is the next request's head.
        self._head_bytes = self._fields = 0

    def _unsupported_upgrade_warning(self) -> None:
        # The request is served as plain HTTP; uvicorn's two warnings per request would let any
        # client flood the log.
        self.logger.debug("Unsupported upgrade request.")

    # the client's clock -------------------------------------------------------------------

    def _arm_clock(self, due: float) -> None:
        self._clock = self.loop.call_at(due, self._clock_due)

    def _clock_due(self) -> None:
        self._clock = None
        if self._rejected or self.transport is None or self.transport.is_closing():
            return
        now = self.loop.time()
        waiting = self._waiting
        if waiting is None:  # between requests: uvicorn's keep-alive timeout closes it
            self._arm_clock(now + self.limits.head_timeout_s)
            return
        if waiting is _BODY and self._body_held_back():
            self._since = now
        limit = self.limits.head_timeout_s if waiting is _HEAD else self.limits.body_timeout_s
        if now < self._since + limit:
            self._arm_clock(self._since + limit)
            return
        self._timed_out(waiting)

    def _body_held_back(self) -> bool:
        """The server, not the client, is why no body comes: reading is paused, or the client
        waits for the `100 Continue` that the app's first read of the body sends."""
        cycle = self.cycle
        return self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)

    def _timed_out(self, waiting: str) -> None:
        if waiting is _HEAD:
            if self._head_bytes == 0 and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()  # nothing of a request came: nothing to answer
                return
            self._reject(
                408,
                f"The request head did not arrive whole within {self.limits.head_timeout_s:g} s "
                "(FIRSTTOKEN_CLIENT_HEAD_TIMEOUT_S).",
                "request_timeout",
            )
            return
        cycle = self.cycle
        self._rejected = True
        if cycle is not None:
            # Its app waits for the rest of the body: it reads a disconnect, and whatever it
            # would still send is dropped.
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if started:
                self.transport.close()
                return
        self._answer(
            408,
            f"The request body stalled: nothing of it for {self.limits.body_timeout_s:g} s "
            "(FIRSTTOKEN_CLIENT_BODY_TIMEOUT_S).",
            "request_timeout",
        )

    # errors -------------------------------------------------------------------------------

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (
            self._deferred is not None
            and not self.pipeline
            and self.cycle.response_complete
            and not self.transport.is_closing()
        ):
            self._unset_keepalive_if_required()
            self._answer(*self._deferred)

    def _reject(self, status: int, message: str, code: str) -> None:
        """Refuse the request being read: nothing more from this connection is parsed."""
        self._rejected = True
        if self.cycle is not None and not self.cycle.response_complete:
            # Earlier requests on this connection are still being answered: the error follows
            # their responses (see on_response_complete).
            self._deferred = (status, message, code)
            return
        self._answer(status, message, code)

    def _answer(
        self,
        status: int,
        message: str,
        code: str,
        *,
        kind: str = "invalid_request_error",
        linger: bool = True,
    ) -> None:
        """Write one JSON error of type `kind` and close the connection, gracefully (`linger`:
        reading what the client still sends for a while, so that it reads the error instead of
        a reset)."""
        self._deferred = None
        body = orjson.dumps(error_body(message, kind, None, code))
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: ",
                str(len(body)).encode(),
                b"\r\n",
                b"connection: close\r\n\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        # Closing with unread input would reset the connection and could discard the answer
        # before the client reads it: half-close, drop what still arrives, close a bit later.
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class CycleBody:
    """`gateway.boundary.direct_body.DirectBody` for a request on this server: the body bytes
    go to the connection's transport framed as uvicorn frames them (chunked: an event stream
    has no length), and uvicorn's flow control says when the client is slow. It holds its
    request weakly: the request's scope holds it, and a strong reference back would make every
    request a reference cycle, its memory (the body included) held until the collector runs."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def ready(self) -> bool:
        cycle = self._cycle()
        return (
            cycle is not None
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and cycle.chunked_encoding is True
        )

    def write(self, data: bytes) -> None:
        cycle = self._cycle()
        if cycle is not None and data and not cycle.disconnected and not cycle.response_complete:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    @property
    def paused(self) -> bool:
        cycle = self._cycle()
        return cycle is not None and bool(cycle.flow.write_paused)

    async def drain(self) -> None:
        cycle = self._cycle()
        if cycle is not None:
            await cycle.flow.drain()


def server_config(
    app: Any, settings: Settings, *, host: str, port: int, **options: Any
) -> uvicorn.Config:
    """The uvicorn `Config` for `app`: the front-door protocol with `settings`' head limits.

    `options` are passed through to uvicorn (log level, loop, lifespan, keep-alive...); the HTTP
    implementation is always this one, whatever else is installed, and WebSocket upgrades are
    off unless asked for (the gateway serves none).
    """
    options.setdefault("ws", "none")
    protocol = functools.partial(FrontDoorProtocol, limits=ClientLimits.from_settings(settings))
    # uvicorn calls `http` as a protocol factory; its annotation admits only a class.
    return uvicorn.Config(app, host=host, port=port, http=protocol, **options)  # type: ignore[arg-type]


class QuietServer(uvicorn.Server):
    """uvicorn's server, waking its loop once a second instead of ten times.

    uvicorn's main loop sleeps 100 ms at a time to refresh the Date header (once a second) and
    to see whether it should exit. Between streams every wake-up of the gateway costs a cold
    start of the interpreter's working set: on the bench machine about 0.2 ms of CPU each
    (`bench/fleet_http.py` measures the idle gateway), so those ten a second were most of an
    idle gateway's CPU. Here the loop ticks every `tick_s`, and a request to exit (a signal, or
    `should_exit` set from any thread) wakes it at once, so stopping is no slower.
    """

    def __init__(self, config: uvicorn.Config, tick_s: float = SERVER_TICK_S) -> None:
        self.tick_s = tick_s
        self._should_exit = False
        self._exit_requested: asyncio.Event | None = None
        self._exit_loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, requested = self._exit_loop, self._exit_requested
        if value and loop is not None and requested is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(requested.set)

    async def main_loop(self) -> None:
        self._exit_loop = asyncio.get_running_loop()
        self._exit_requested = asyncio.Event()
        counter = 0
        # uvicorn's `on_tick` counts tenths of a second (the Date header changes when the count
        # is a multiple of ten): each tick here is a whole second of them.
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_requested.wait(), self.tick_s)
