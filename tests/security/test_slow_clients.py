"""A client that sends part of a request and then nothing does not hold its connection forever.

uvicorn times out only the idle wait between requests: half a head, or half a body, held the
connection (and what it had sent) for as long as the client liked, and enough of them exhaust
the process's file descriptors. The front door gives a new connection `client_head_timeout_s` to
begin its head and a head as long again from its first byte to its end; a body may pause at most
`client_body_timeout_s` between two reads, unless the server itself has paused reading it.

Past `max_connections` held at once a new connection is refused with a 503, so that clients
cannot take the open files the gateway needs to reach its upstreams.

The protocol runs here on a loop whose clock the test moves (`_SteppedClock`), so what is
asserted does not depend on how fast a loaded machine runs the test; one test goes through a
real gateway's socket to show the clock is wired into the served protocol.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from uvicorn.server import ServerState

from gateway.config.settings import Settings
from gateway.run.server import server_config
from tests.security.test_front_door import read_all
from tests.support.gateway import openai_route
from tests.support.transport import FakeTransport

pytestmark = pytest.mark.timeout(60)

HEAD_S, BODY_S = 30.0, 60.0


class _SteppedClock:
    """The real loop for everything, except the time and the timers set with `call_at`: those
    run when the test moves the clock (`advance`), each at its own due time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = 1000.0
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Any:
        entry: list[bool] = [False]

        def run() -> None:
            if not entry[0]:
                callback(*args)

        heapq.heappush(self._due, (when, next(self._order), run))
        return _Handle(entry)

    def advance(self, seconds: float) -> None:
        until = self.now + seconds
        while self._due and self._due[0][0] <= until:
            when, _, run = heapq.heappop(self._due)
            self.now = max(self.now, when)
            run()
        self.now = until


class _Handle:
    def __init__(self, entry: list[bool]) -> None:
        self._entry = entry

    def cancel(self) -> None:
        self._entry[0] = True


class _Client:
    """One connection to a front door on the stepped clock; `seen` is what its app received."""

    def __init__(self, clock: _SteppedClock, protocol: Any, transport: FakeTransport) -> None:
        self.clock = clock
        self.protocol = protocol
        self.transport = transport
        self.seen: list[str] = []

    def send(self, data: bytes) -> None:
        self.protocol.data_received(data)

    @property
    def answers(self) -> int:
        return bytes(self.transport.written).count(b"HTTP/1.1 ")


async def _reads_body(scope: dict, receive: Any, send: Any, seen: list[str]) -> None:
    while True:
        message = await receive()
        seen.append(message["type"])
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _connect(
    reading: asyncio.Event | None = None, state: ServerState | None = None, **settings: Any
) -> _Client:
    """A connection to a front door whose app reads the body at once, or once `reading` is
    set (`state`: the server's, shared by its connections)."""
    loop = asyncio.get_running_loop()
    clock = _SteppedClock(loop)
    seen: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if reading is not None:
            await reading.wait()
        await _reads_body(scope, receive, send, seen)

    limits = Settings(client_head_timeout_s=HEAD_S, client_body_timeout_s=BODY_S, **settings)
    config = server_config(app, limits, host="127.0.0.1", port=1, log_level="warning")
    config.load()
    protocol = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state or ServerState(), app_state={}, _loop=clock
    )
    transport = FakeTransport()
    protocol.connection_made(transport)
    client = _Client(clock, protocol, transport)
    client.seen = seen
    return client


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def _body_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


def _error(written: bytes) -> dict:
    head, _, body = written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in head
    return orjson.loads(body)["error"]


def test_a_connection_that_sends_nothing_is_closed_without_an_answer() -> None:
    async def run() -> None:
        client = _connect()
        client.clock.advance(HEAD_S - 1)
        assert not client.transport.closed
        client.clock.advance(2)
        assert client.transport.closed
        assert client.transport.written == b""

    asyncio.run(run())


def test_half_a_head_gets_a_408_once_the_head_time_is_up() -> None:
    async def run() -> None:
        client = _connect()
        client.clock.advance(10)
        client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n")  # and nothing more
        client.clock.advance(HEAD_S - 1)  # counted from the head's first byte
        assert not client.transport.closed
        client.clock.advance(2)
        assert client.transport.closed
        error = _error(bytes(client.transport.written))
        assert error["code"] == "request_timeout"
        assert "FIRSTTOKEN_CLIENT_HEAD_TIMEOUT_S" in error["message"]

    asyncio.run(run())


def test_a_stalled_body_gets_a_408_and_its_app_reads_a_disconnect() -> None:
    async def run() -> None:
        client = _connect()
        client.send(_body_head(100) + b"x" * 10)
        await _settle()
        client.clock.advance(BODY_S - 1)
        client.send(b"x" * 10)  # a read within the time: the clock starts again
        await _settle()
        client.clock.advance(BODY_S - 1)
        assert not client.transport.closed
        client.clock.advance(2)
        await _settle()
        assert client.transport.closed
        assert client.answers == 1  # ours; the app's answer to a gone client is dropped
        error = _error(bytes(client.transport.written))
        assert "FIRSTTOKEN_CLIENT_BODY_TIMEOUT_S" in error["message"]
        assert client.seen[-1] == "http.disconnect"

    asyncio.run(run())


def test_a_body_the_server_holds_back_is_not_the_clients_delay() -> None:
    async def run() -> None:
        client = _connect()
        client.send(_body_head(100) + b"x" * 10)
        await _settle()
        client.protocol.flow.pause_reading()
        client.clock.advance(10 * BODY_S)
        assert not client.transport.closed
        client.protocol.flow.resume_reading()
        client.clock.advance(2 * BODY_S)  # the client's own time runs again: it sends nothing
        assert client.transport.closed
        assert (
            "FIRSTTOKEN_CLIENT_BODY_TIMEOUT_S" in _error(bytes(client.transport.written))["message"]
        )

    asyncio.run(run())


def test_a_client_waiting_for_100_continue_is_not_late_until_it_is_sent() -> None:
    async def run() -> None:
        reading = asyncio.Event()
        client = _connect(reading)
        client.send(_body_head(2).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        await _settle()
        client.clock.advance(10 * BODY_S)  # the app has not asked for the body yet
        assert not client.transport.closed
        reading.set()
        await _settle()
        assert bytes(client.transport.written).startswith(b"HTTP/1.1 100 ")
        client.clock.advance(2 * BODY_S)  # asked for, and the client sends nothing
        await _settle()
        assert client.transport.closed
        assert b"HTTP/1.1 408 " in bytes(client.transport.written)

    asyncio.run(run())


def test_a_whole_request_and_an_idle_connection_are_left_to_keep_alive() -> None:
    async def run() -> None:
        client = _connect()
        client.send(_body_head(2) + b"{}")
        await _settle()
        assert bytes(client.transport.written).startswith(b"HTTP/1.1 200 ")
        client.clock.advance(10 * BODY_S)  # idle between requests: not this clock's to close
        assert not client.transport.closed
        assert client.answers == 1

    asyncio.run(run())


def test_a_real_gateway_answers_half_a_head_with_408(mock_upstream, make_gateway) -> None:
    gw = make_gateway([openai_route(mock_upstream)], client_head_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")  # the blank line never comes
        answer = read_all(sock, time.monotonic() + 30)
    error = _error(answer)
    assert error["code"] == "request_timeout"


def test_a_connection_past_the_cap_gets_a_503_and_is_closed() -> None:
    async def run() -> None:
        state = ServerState()
        first = _connect(state=state, max_connections=2)
        second = _connect(state=state, max_connections=2)
        third = _connect(state=state, max_connections=2)
        assert not first.transport.closed and not second.transport.closed
        assert third.transport.closed
        head, _, body = bytes(third.transport.written).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        error = orjson.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert "FIRSTTOKEN_MAX_CONNECTIONS" in error["message"]
        third.protocol.connection_lost(None)
        first.protocol.connection_lost(None)
        fourth = _connect(state=state, max_connections=2)  # one left: there is room again
        assert not fourth.transport.closed
        fourth.send(_body_head(2) + b"{}")
        await _settle()
        assert bytes(fourth.transport.written).startswith(b"HTTP/1.1 200 ")

    asyncio.run(run())


def test_the_default_cap_is_half_the_open_files_and_start_up_raises_them() -> None:
    script = (
        "import resource\n"
        "from gateway.run.server import default_max_connections, raise_open_file_limit\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))\n"
        "print(default_max_connections())\n"
        "raise_open_file_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    before, after = done.stdout.splitlines()
    assert int(before) == (512 - 64) // 2
    soft, hard = (int(v) for v in after.split())
    assert soft == (1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20))


def test_a_real_gateway_refuses_a_connection_past_its_cap(mock_upstream, make_gateway) -> None:
    gw = make_gateway([openai_route(mock_upstream)], max_connections=2)
    ask = b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"
    held = [socket.create_connection(("127.0.0.1", gw.port), timeout=30) for _ in range(2)]
    try:
        for sock in held:  # answered: each is a connection the gateway holds
            sock.sendall(ask)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as extra:
            answer = read_all(extra, time.monotonic() + 30)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"too_many_connections" in answer
    finally:
        for sock in held:
            sock.close()
