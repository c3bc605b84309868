"""`UpstreamHttp.read_origin_text`: a replica's `/metrics`, read on a pool of its own at the
route's origin, within a time and byte limit, and never holding its connections after a
failure."""

from __future__ import annotations

import asyncio
import re

import pytest

from gateway.config.routes import Route
from gateway.upstreams.http import ORIGIN_READS, UpstreamHttp

LIMIT_S = 20.0  # the test's own bound: a hang fails it, never the suite


class Origin:
    """A loopback server answering each request with the next of `answers` (None: never)."""

    def __init__(self, *answers: bytes | None) -> None:
        self.answers = list(answers)
        self.heads: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> Origin:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                self.heads.append(await reader.readuntil(b"\r\n\r\n"))
                answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
                if answer is None:
                    await asyncio.sleep(LIMIT_S)
                    return
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def run(coro) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(LIMIT_S):
            await coro

    asyncio.run(bounded())


def http_for(port: int) -> UpstreamHttp:
    route = Route(
        name="fleet",
        models=["*"],
        kind="openai",
        base_url=f"http://127.0.0.1:{port}/v1",
        headers={"x-team": "a"},
    )
    return UpstreamHttp(route, {"authorization": "Bearer sk-route"})


def test_metrics_are_read_at_the_origin_with_the_routes_headers_on_one_connection() -> None:
    async def main() -> None:
        async with Origin(answer(b"vllm:num_requests_waiting 2\n")) as origin:
            http = http_for(origin.port)
            await http.start()
            for _ in range(3):
                text = await http.read_origin_text("/metrics", 5.0, 1024)
                assert text == "vllm:num_requests_waiting 2\n"
            await http.aclose()
            assert origin.connections == 1
            head = origin.heads[0]
            assert head.startswith(b"GET /metrics HTTP/1.1\r\n")  # beside /v1, not under it
            assert re.search(rb"(?i)\r\nauthorization: Bearer sk-route\r\n", head)
            assert re.search(rb"(?i)\r\nx-team: a\r\n", head)

    run(main())


@pytest.mark.parametrize(
    "bad",
    [answer(b"not here", b"404 Not Found"), answer(b"x" * 2048), None],
    ids=["not 200", "over the byte limit", "never answers"],
)
def test_a_failed_read_is_none_and_gives_its_connection_back(bad: bytes | None) -> None:
    async def main() -> None:
        # more failures than the pool has connections, then a good answer: each failure must
        # have given its slot back, or the last read would wait forever
        answers = [bad] * (ORIGIN_READS + 1) + [answer(b"ok")]
        async with Origin(*answers) as origin:
            http = http_for(origin.port)
            await http.start()
            for _ in range(ORIGIN_READS + 1):
                assert await http.read_origin_text("/metrics", 0.3, 1024) is None
            assert await http.read_origin_text("/metrics", 5.0, 1024) == "ok"
            await http.aclose()

    run(main())


def test_an_origin_that_refuses_connections_reads_as_none() -> None:
    async def main() -> None:
        async with Origin(answer(b"")) as origin:
            port = origin.port
        http = http_for(port)  # the server is gone: nothing listens there any more
        await http.start()
        assert await http.read_origin_text("/metrics", 2.0, 1024) is None
        await http.aclose()

    run(main())


def test_an_unstarted_route_reads_nothing() -> None:
    http = http_for(1)
    assert asyncio.run(http.read_origin_text("/metrics", 1.0, 1024)) is None
