"""The generation requests' HTTP/1.1 client (`gateway.upstreams.http1`) against scripted
loopback servers, on asyncio's loop and on uvloop's (the one `firsttoken serve` runs).

Each server answers its n-th connection with the n-th handler of its script (the last one
again after that) and counts connections, so reuse is asserted exactly."""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from gateway.upstreams.http1 import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    AnswerBroken,
    Http1Pool,
    Origin,
    request_head,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}
JSON = {"content-type": "application/json"}
LIMIT_S = 20.0  # every test's own bound: a hang fails, it never blocks the suite


@pytest.fixture(params=sorted(LOOPS))
def run(request) -> Callable[[Coroutine[Any, Any, None]], None]:
    def go(coro: Coroutine[Any, Any, None]) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(LIMIT_S):
                await coro

        LOOPS[request.param](bounded())

    return go


class Script:
    """A loopback server: connection n is served by handler n (the last one after that)."""

    def __init__(self, *handlers: Handler) -> None:
        self.handlers = handlers
        self.connections = 0

    async def __aenter__(self) -> Script:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = self.handlers[min(self.connections, len(self.handlers) - 1)]
        self.connections += 1
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    found = re.search(rb"(?i)content-length: (\d+)", head)
    return head + await reader.readexactly(int(found.group(1)) if found else 0)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
END = b"0\r\n\r\n"


def answer(body: bytes = b"ok") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def serve_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(answer())
        await writer.drain()


async def read_all(pool: Http1Pool, path: str = "/chat/completions") -> bytes:
    resp = await pool.post(path, JSON, b"{}")
    return b"".join([c async for c in resp.content.iter_any()])


def test_each_read_reaches_the_reader_as_it_arrives(run) -> None:
    first_read = asyncio.Event()

    async def streams(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))
        await first_read.wait()  # nothing more until the client has the first event
        writer.write(chunk(b"data: b\n\n") + END)
        await read_request(reader)

    async def main() -> None:
        async with Script(streams) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            reads = resp.content.iter_any()
            assert await anext(reads) == b"data: a\n\n"
            first_read.set()
            assert [c async for c in reads] == [b"data: b\n\n"]
            await pool.aclose()

    run(main())


def test_a_connection_is_reused_once_its_answer_has_ended(run) -> None:
    async def main() -> None:
        async with Script(serve_forever) as server:
            pool = Http1Pool(server.url)
            assert [await read_all(pool) for _ in range(3)] == [b"ok"] * 3
            assert server.connections == 1
            await pool.aclose()

    run(main())


def test_a_released_stream_is_drained_in_the_background_and_reused(run) -> None:
    released = asyncio.Event()

    async def done_then_terminator(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: [DONE]\n\n"))
        await released.wait()  # the terminator comes only after the reader let go
        writer.write(END)
        await serve_forever(reader, writer)

    async def main() -> None:
        async with Script(done_then_terminator) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            assert await anext(resp.content.iter_any()) == b"data: [DONE]\n\n"
            resp.release()
            assert resp.closed and pool.idle_connections == 0  # draining
            released.set()
            while not pool.idle_connections:
                await asyncio.sleep(0.01)
            assert await read_all(pool) == b"ok"
            assert server.connections == 1
            await pool.aclose()

    run(main())


def test_a_closed_stream_drops_its_connection(run) -> None:
    async def endless(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))
        await reader.read()  # until the client hangs up

    async def main() -> None:
        async with Script(endless, serve_forever) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            assert await anext(resp.content.iter_any()) == b"data: a\n\n"
            resp.close()
            assert await read_all(pool) == b"ok"
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_an_idle_connection_the_server_dropped_is_retried_once(run) -> None:
    async def one_then_drop(reader, writer) -> None:
        await read_request(reader)
        writer.write(answer(b"first"))
        await read_request(reader)  # the next request arrives, and the server hangs up

    async def main() -> None:
        async with Script(one_then_drop, serve_forever) as server:
            pool = Http1Pool(server.url)
            assert await read_all(pool) == b"first"
            assert await read_all(pool) == b"ok"
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_a_new_connection_closed_before_any_answer_fails_without_a_retry(run) -> None:
    async def hang_up(reader, writer) -> None:
        await read_request(reader)

    async def main() -> None:
        async with Script(hang_up) as server:
            pool = Http1Pool(server.url, size=1)
            with pytest.raises(AnswerBroken):
                await pool.post("/chat/completions", JSON, b"{}")
            assert server.connections == 1
            with pytest.raises(AnswerBroken):  # the slot was given back
                await pool.post("/chat/completions", JSON, b"{}")
            await pool.aclose()

    run(main())


def test_an_answer_cut_mid_body_raises_after_what_arrived(run) -> None:
    async def cut(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))

    async def main() -> None:
        async with Script(cut) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            got = []
            with pytest.raises(AnswerBroken):
                async for data in resp.content.iter_any():
                    got.append(data)
            assert got == [b"data: a\n\n"]
            await pool.aclose()

    run(main())


def test_an_answer_without_a_length_ends_with_its_connection(run) -> None:
    async def until_eof(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello, ")
        await writer.drain()
        writer.write(b"world")

    async def main() -> None:
        async with Script(until_eof) as server:
            pool = Http1Pool(server.url)
            assert await read_all(pool) == b"hello, world"
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x-many: 1\r\n" * 200 + b"content-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 2\r\n\r\nok",
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" * 4000,
    ],
    ids=["huge-head", "many-headers", "compressed", "garbage", "endless-interim-heads"],
)
def test_an_answer_that_breaks_a_limit_or_http_is_refused(run, head) -> None:
    async def answers(reader, writer) -> None:
        await read_request(reader)
        writer.write(head)
        await reader.read()

    async def main() -> None:
        async with Script(answers) as server:
            pool = Http1Pool(server.url)
            with pytest.raises(AnswerBroken):
                await pool.post("/chat/completions", JSON, b"{}")
            assert pool.open_connections == 0 or await _closes(pool)
            await pool.aclose()

    run(main())


async def _closes(pool: Http1Pool) -> bool:
    while pool.open_connections:
        await asyncio.sleep(0.01)
    return True


def flooding(total: int, blocked: asyncio.Event) -> Handler:
    """A handler that streams `total` bytes in 64 KiB chunks and sets `blocked` once its writes
    stall (the client stopped reading: the kernel's buffers are full)."""
    piece = b"x" * 65536

    async def floods(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        sent = 0
        while sent < total:
            writer.write(chunk(piece))
            sent += len(piece)
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
            except TimeoutError:
                blocked.set()
                await writer.drain()
        writer.write(END)
        await writer.drain()

    return floods


def test_a_slow_reader_pauses_the_socket(run) -> None:
    total = 32 * 1024 * 1024
    blocked = asyncio.Event()

    async def main() -> None:
        async with Script(flooding(total, blocked)) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            await blocked.wait()
            assert resp._buffered <= HIGH_WATER + 1024 * 1024  # a paused socket, one read over
            received = 0
            async for data in resp.content.iter_any():
                received += len(data)
            assert received == total
            await pool.aclose()

    run(main())


def test_the_pool_holds_at_most_size_connections_and_a_dropped_answer_gives_its_slot_back(
    run,
) -> None:
    async def main() -> None:
        async with Script(serve_forever) as server:
            pool = Http1Pool(server.url, size=1)
            held = await pool.post("/chat/completions", JSON, b"{}")
            waiting = asyncio.ensure_future(read_all(pool))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not waiting.done()  # the one slot is held
            del held
            gc.collect()
            assert await waiting == b"ok"
            await pool.aclose()

    run(main())


def test_an_interim_answer_is_skipped(run) -> None:
    async def early_hints(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + answer(b"final"))
        await reader.read()

    async def main() -> None:
        async with Script(early_hints) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            assert resp.status == 200
            assert [name for name, _ in resp.raw_headers] == [b"content-length"]
            assert b"".join([c async for c in resp.content.iter_any()]) == b"final"
            await pool.aclose()

    run(main())


def test_bytes_nobody_asked_for_close_the_connection(run) -> None:
    async def chatty(reader, writer) -> None:
        await read_request(reader)
        writer.write(answer(b"one"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(answer(b"unasked"))
        await reader.read()

    async def main() -> None:
        async with Script(chatty, serve_forever) as server:
            pool = Http1Pool(server.url)
            assert await read_all(pool) == b"one"
            await _closes(pool)  # the unasked answer closed the parked connection
            assert await read_all(pool) == b"ok"
            assert server.connections == 2
            await pool.aclose()

    run(main())


def test_the_request_head_is_the_one_aiohttp_sends() -> None:
    origin = Origin("https://api.openai.com/v1")
    head = request_head(
        origin, origin.target("/chat/completions"), {"content-type": "application/json"}, 7
    )
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
        b"content-type: application/json\r\nAccept: */*\r\nContent-Length: 7\r\n\r\n"
    )
    v6 = Origin("http://[::1]:8000/v1")
    assert b"Host: [::1]:8000\r\n" in request_head(v6, v6.target("/x"), {}, 0)
    google = Origin("https://aiplatform.googleapis.com/v1/projects/p")
    assert google.target("/models/a b:streamGenerateContent?alt=sse") == (
        "/v1/projects/p/models/a%20b:streamGenerateContent?alt=sse"
    )


def test_a_get_goes_without_a_body_and_its_connection_is_reused(run) -> None:
    heads: list[bytes] = []

    async def records(reader, writer) -> None:
        while True:
            heads.append(await read_request(reader))
            writer.write(answer(b"vllm:num_requests_waiting 3\n"))
            await writer.drain()

    async def main() -> None:
        async with Script(records) as server:
            pool = Http1Pool(server.url.removesuffix("/v1"))
            for _ in range(2):
                resp = await pool.get("/metrics", {"accept-encoding": "identity"})
                body = b"".join([c async for c in resp.content.iter_any()])
                assert resp.status == 200 and body == b"vllm:num_requests_waiting 3\n"
            assert server.connections == 1
            await pool.aclose()

    run(main())
    host = heads[0].split(b"\r\n")[1]
    assert heads[0] == (
        b"GET /metrics HTTP/1.1\r\n" + host + b"\r\naccept-encoding: identity\r\n"
        b"Accept: */*\r\n\r\n"
    )  # no Content-Length: a GET has no body


def test_credentials_in_the_base_url_go_as_basic_auth_as_aiohttp_sends_them() -> None:
    origin = Origin("http://vllm%40lab:s3cret@gpu-box:8000/v1")
    assert origin.host_header == "gpu-box:8000" and origin.target("/x") == "/v1/x"
    head = request_head(origin, "/v1/x", {}, 0)
    assert b"Authorization: Basic dmxsbUBsYWI6czNjcmV0\r\n" in head  # vllm@lab:s3cret
    bearer = request_head(origin, "/v1/x", {"authorization": "Bearer k"}, 0)
    assert b"Basic" not in bearer and b"authorization: Bearer k" in bearer


def test_a_path_cannot_leave_the_origin_and_a_header_cannot_inject() -> None:
    origin = Origin("http://upstream.example")
    with pytest.raises(ValueError):
        origin.target("@evil.example/steal")
    with pytest.raises(ValueError):
        request_head(origin, "/v1", {"x-beta": "a\r\nx-injected: 1"}, 0)
    with pytest.raises(ValueError):
        Origin("ftp://upstream.example")


def test_the_media_type_reads_as_aiohttp_reads_it(run) -> None:
    heads = [
        b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\n",
        b"HTTP/1.1 200 OK\r\n",
    ]

    async def typed(reader, writer) -> None:
        for head in heads:
            await read_request(reader)
            writer.write(head + b"content-length: 0\r\n\r\n")
        await reader.read()

    async def main() -> None:
        async with Script(typed) as server:
            pool = Http1Pool(server.url)
            for expected in ("text/event-stream", "application/octet-stream"):
                resp = await pool.post("/chat/completions", JSON, b"{}")
                assert resp.content_type == expected
                assert resp.headers.get("content-length") == "0"
                resp.release()
            assert server.connections == 1
            await pool.aclose()

    run(main())


def self_signed(tmp_path, host: str = "localhost") -> tuple[str, str]:
    """A certificate for `host` and its key, as PEM files (the certificate is its own CA)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


def test_https_checks_the_servers_certificate_and_reuses_its_connection(run, tmp_path) -> None:
    import ssl

    cert, key = self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    connections = []

    async def serve(reader, writer) -> None:
        connections.append(writer)
        try:
            await serve_forever(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_tls)
        port = server.sockets[0].getsockname()[1]
        url = f"https://localhost:{port}/v1"
        trusted = Http1Pool(url)
        trusted.origin.__dict__["tls"] = ssl.create_default_context(cafile=cert)
        assert [await read_all(trusted) for _ in range(3)] == [b"ok"] * 3
        assert len(connections) == 1
        stranger = Http1Pool(url)  # the system's CAs: this certificate is nobody's
        with pytest.raises(ssl.SSLCertVerificationError):
            await stranger.post("/chat/completions", JSON, b"{}")
        await trusted.aclose()
        await stranger.aclose()
        server.close()

    run(main())


def test_warm_connections_serve_the_first_requests(run) -> None:
    async def main() -> None:
        async with Script(serve_forever) as server:
            pool = Http1Pool(server.url)
            await pool.warm(2, timeout_s=5.0)
            assert pool.idle_connections == 2
            assert await read_all(pool) == b"ok"
            assert server.connections == 2  # the request took a warm one; none was opened
            await pool.aclose()

    run(main())


# A diverted answer: its reads go to a function from the read callback ------------------------


class Sink:
    """What a diverted answer handed over, read by read; `over_at`: the read (1-based) after
    which it wants nothing more."""

    def __init__(self, over_at: int | None = None, fail: bool = False) -> None:
        self.reads: list[bytes] = []
        self.over_at = over_at
        self.fail = fail

    def __call__(self, data: bytes) -> bool:
        self.reads.append(data)
        if self.fail:
            raise ValueError("the reader broke")
        return self.over_at is not None and len(self.reads) >= self.over_at


def test_a_diverted_answer_goes_to_its_sink_as_it_arrives_and_its_connection_is_reused(
    run,
) -> None:
    first_read = asyncio.Event()
    more = asyncio.Event()

    async def streams(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))
        await first_read.wait()
        writer.write(chunk(b"data: b\n\n"))
        await more.wait()
        writer.write(chunk(b"data: c\n\n") + END)
        await serve_forever(reader, writer)

    async def main() -> None:
        async with Script(streams) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            assert await anext(resp.content.iter_any()) == b"data: a\n\n"
            sink = Sink()
            resp.divert(sink)
            first_read.set()
            while not sink.reads:  # delivered by the read callback: no reader runs
                await asyncio.sleep(0.005)
            assert sink.reads == [b"data: b\n\n"]
            more.set()
            assert await resp.diverted_end() is False  # the body ended whole
            assert b"".join(sink.reads) == b"data: b\n\ndata: c\n\n"
            resp.release()
            assert await read_all(pool) == b"ok"
            assert server.connections == 1
            await pool.aclose()

    run(main())


def test_bytes_waiting_when_diverted_go_at_once_and_true_ends_the_handover(run) -> None:
    sent_rest = asyncio.Event()

    async def streams(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))
        await sent_rest.wait()
        writer.write(chunk(b"data: after\n\n") + END)
        await serve_forever(reader, writer)

    async def main() -> None:
        async with Script(streams) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            while not resp._buffered:
                await asyncio.sleep(0.005)
            sink = Sink(over_at=1)
            resp.divert(sink)
            assert sink.reads == [b"data: a\n\n"]  # at once, before any await
            assert await resp.diverted_end() is True
            sent_rest.set()
            resp.release()  # what follows is drained, not handed over, and the connection kept
            while not resp._done:
                await asyncio.sleep(0.005)
            assert await read_all(pool) == b"ok"
            assert sink.reads == [b"data: a\n\n"]
            assert server.connections == 1
            await pool.aclose()

    run(main())


def test_a_diverted_answer_cut_mid_body_raises_and_a_failing_sink_ends_it(run) -> None:
    async def cut(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"data: a\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)

    async def endless(reader, writer) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        for _ in range(1000):
            writer.write(chunk(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.005)

    async def main() -> None:
        async with Script(cut, endless) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            resp.divert(Sink())
            with pytest.raises(AnswerBroken):
                await resp.diverted_end()
            resp.close()
            resp = await pool.post("/chat/completions", JSON, b"{}")
            sink = Sink(fail=True)
            resp.divert(sink)
            with pytest.raises(ValueError, match="the reader broke"):
                await resp.diverted_end()
            assert len(sink.reads) == 1  # nothing more once it failed
            resp.close()
            assert await _closes(pool)
            await pool.aclose()

    run(main())


def test_a_paused_diverted_answer_stops_reading_until_resumed(run) -> None:
    total = 16 * 1024 * 1024
    blocked = asyncio.Event()

    async def main() -> None:
        async with Script(flooding(total, blocked)) as server:
            pool = Http1Pool(server.url)
            resp = await pool.post("/chat/completions", JSON, b"{}")
            received = [0]

            def sink(data: bytes) -> bool:
                received[0] += len(data)
                return False

            resp.divert(sink)
            resp.pause()
            await blocked.wait()
            assert received[0] < total // 2  # a paused socket, not a buffer filling up
            resp.resume()
            assert await resp.diverted_end() is False
            assert received[0] == total
            resp.release()
            await pool.aclose()

    run(main())
