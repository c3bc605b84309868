"""A mock OpenAI-compatible (and Anthropic Messages) upstream for tests and benches.

It streams like the real APIs (role chunk, content chunks, finish chunk, optional usage chunk,
`[DONE]`) with configurable delays, and can be scripted to fail, to hold an event until told,
and to report whether a client dropped its connection. Run it alone with
`python -m bench.mock_openai --port 9000 --first-ms 50 --chunks 20 --gap-ms 5`.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web


@dataclass
class MockBehaviour:
    first_delay_s: float = 0.0
    chunks: int = 5
    gap_s: float = 0.0
    prompt_tokens: int = 10
    cached_tokens: int = 0
    fail_statuses: list[int] = field(default_factory=list)   # consumed one per request
    retry_after: str | None = None
    hold_after_first: asyncio.Event | None = None            # for the no-buffering test
    die_after_chunks: int | None = None                      # cut the connection mid-stream
    cut_before_events: bool = False                          # headers, then a cut
    tool_call: bool = False


class MockUpstream:
    def __init__(self, behaviour: MockBehaviour | None = None) -> None:
        self.behaviour = behaviour or MockBehaviour()
        self.requests: list[dict] = []          # {"path", "headers", "body"}
        self.disconnects: list[float] = []      # times a streaming client went away
        self.sent_first: list[float] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_post("/v1/messages", self.anthropic_messages)

    # -- helpers ---------------------------------------------------------------------------
    async def _record(self, request: web.Request) -> dict:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return body

    def _failure(self) -> web.Response | None:
        if self.behaviour.fail_statuses:
            status = self.behaviour.fail_statuses.pop(0)
            headers = {"retry-after": self.behaviour.retry_after} if self.behaviour.retry_after else {}
            return web.json_response({"error": {"message": f"mock failure {status}",
                                                "type": "mock_error", "param": None, "code": None}},
                                     status=status, headers=headers)
        return None

    async def _client_left_during(self, request: web.Request, seconds: float) -> bool:
        """Wait, noting (like a real server would) a client that goes away meanwhile."""
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                self.disconnects.append(time.perf_counter())
                return True
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.perf_counter())))
        return False

    def _usage(self, completion: int) -> dict:
        b = self.behaviour
        return {"prompt_tokens": b.prompt_tokens, "completion_tokens": completion,
                "total_tokens": b.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": b.cached_tokens}}

    # -- OpenAI ----------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        b = self.behaviour
        model = body.get("model", "mock")
        words = [f"tok{i} " for i in range(b.chunks)]
        if not body.get("stream"):
            if await self._client_left_during(request, b.first_delay_s + b.gap_s * b.chunks):
                return web.Response(status=499)
            message: dict = {"role": "assistant", "content": "".join(words)}
            finish = "stop"
            if b.tool_call:
                message = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
                finish = "tool_calls"
            return web.json_response({
                "id": "chatcmpl-mock", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": self._usage(b.chunks), "x_unknown_field": {"kept": True}})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model}

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({**base, "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

        try:
            await asyncio.sleep(b.first_delay_s)
            if b.cut_before_events:
                request.transport.close()
                return resp
            await resp.write(chunk({"role": "assistant", "content": ""}))
            if b.tool_call:
                await resp.write(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather",
                                                                     "arguments": ""}}]}))
                for part in ('{"city":', '"Paris"}'):
                    await resp.write(chunk({"tool_calls": [{"index": 0,
                                                            "function": {"arguments": part}}]}))
                await resp.write(chunk({}, "tool_calls"))
            else:
                for i, word in enumerate(words):
                    if i:
                        await asyncio.sleep(b.gap_s)
                    if b.die_after_chunks is not None and i >= b.die_after_chunks:
                        request.transport.close()
                        return resp
                    await resp.write(chunk({"content": word}))
                    if i == 0:
                        self.sent_first.append(time.perf_counter())
                        if b.hold_after_first is not None:
                            await b.hold_after_first.wait()
                await resp.write(chunk({}, "stop"))
            if include_usage:
                await resp.write(b"data: " + orjson.dumps({**base, "choices": [],
                                                           "usage": self._usage(b.chunks)}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects.append(time.perf_counter())
            raise
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        b = self.behaviour
        base = {"id": "cmpl-mock", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model", "mock")}
        if not body.get("stream"):
            return web.json_response({**base, "choices": [{"index": 0, "text": "hello world",
                                                           "finish_reason": "stop", "logprobs": None}],
                                      "usage": self._usage(2)})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(b.first_delay_s)
        for text in ("hello", " world"):
            await resp.write(b"data: " + orjson.dumps({**base, "choices": [
                {"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({**base, "choices": [],
                                                       "usage": self._usage(2)}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "mock-model", "object": "model", "created": 0, "owned_by": "mock"}]})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return web.json_response({"object": "list", "model": body.get("model"), "data": [
            {"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3}})

    # -- Anthropic -------------------------------------------------------------------------
    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        usage = {"input_tokens": 5, "output_tokens": 1, "cache_read_input_tokens": 100,
                 "cache_creation_input_tokens": 20}
        if not body.get("stream"):
            return web.json_response({
                "id": "msg_mock", "type": "message", "role": "assistant", "model": body["model"],
                "content": [{"type": "text", "text": "Hello from Claude"}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {**usage, "output_tokens": 4}})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n")

        await asyncio.sleep(self.behaviour.first_delay_s)
        await event("message_start", {"type": "message_start", "message": {
            "id": "msg_mock", "type": "message", "role": "assistant", "model": body["model"],
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
        await event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        await event("ping", {"type": "ping"})
        for text in ("Hello", " from", " Claude"):
            await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": text}})
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        if body.get("tools"):
            await event("content_block_start", {"type": "content_block_start", "index": 1,
                                                 "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                   "name": "get_weather", "input": {}}})
            for part in ('{"city": ', '"Paris"}'):
                await event("content_block_delta", {"type": "content_block_delta", "index": 1,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": part}})
            await event("content_block_stop", {"type": "content_block_stop", "index": 1})
        stop = "tool_use" if body.get("tools") else "end_turn"
        await event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": 3}})
        await event("message_stop", {"type": "message_stop"})
        return resp


class ThreadedServer:
    """Runs an aiohttp app on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, mock: MockUpstream, port: int = 0) -> None:
        self.mock = mock
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.mock.app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def call(self, fn) -> None:
        self.loop.call_soon_threadsafe(fn)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--first-ms", type=float, default=50)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=5)
    args = parser.parse_args()
    mock = MockUpstream(MockBehaviour(first_delay_s=args.first_ms / 1000, chunks=args.chunks,
                                      gap_s=args.gap_ms / 1000))
    mock.requests = _Discard()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(mock.app, host="127.0.0.1", port=args.port, print=None, access_log=None)


class _Discard(list):
    """The standalone server keeps no request log (bounded memory under load)."""

    def append(self, item) -> None:
        pass


if __name__ == "__main__":
    main()
