"""A mock OpenAI-compatible (and Anthropic Messages) upstream for tests and benches.

It streams like the real APIs (role chunk, content chunks, finish chunk, optional usage chunk,
`[DONE]`) with configurable delays, and can be scripted to fail, to hold an event until told,
and to report whether a client dropped its connection. Run it alone with
`python -m bench.mock_openai --port 9000 --first-ms 50 --chunks 20 --gap-ms 5`; add
`--slow-share 0.05 --slow-first-ms 2000 --seed 1` to make a seeded random share of chat requests
slow to their first token (a tail for hedging to cut). `GET /mock/stats` counts what it served.
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
    fail_statuses: list[int] = field(default_factory=list)  # consumed one per request
    retry_after: str | None = None
    hold_after_first: asyncio.Event | None = None  # for the no-buffering test
    die_after_chunks: int | None = None  # cut the connection mid-stream
    cut_before_events: bool = False  # headers, then a cut
    tool_call: bool = False
    # object endpoints (files, batches, responses): see the "Objects" section
    redirect_to: str | None = None  # answer 307 to this base URL
    hang_s: float = 0.0  # wait (streams: after event 1)
    object_headers: dict[str, str] = field(default_factory=dict)  # extra response headers
    answer_headers: dict[str, str] = field(default_factory=dict)  # on chat/messages answers
    pad_bytes: int = 0  # padding added to list bodies
    huge_event_bytes: int = 0  # a response stream event this big
    # chat: this share of requests (drawn from the mock's seeded generator) waits
    # slow_first_delay_s instead of first_delay_s before its first event
    slow_share: float = 0.0
    slow_first_delay_s: float = 0.0


class MockUpstream:
    def __init__(self, behaviour: MockBehaviour | None = None, seed: int = 0) -> None:
        self.behaviour = behaviour or MockBehaviour()
        self.requests: list[dict] = []  # {"path", "headers", "body", "at": perf_counter}
        self.disconnects: list[float] = []  # times a streaming client went away
        self.sent_first: list[float] = []
        self.chat_requests = 0  # counted even where `requests` keeps nothing (standalone)
        self.slow_firsts = 0  # chat requests that drew the slow first token
        self._rng = random.Random(seed)
        self.app = web.Application()
        self.app.router.add_get("/mock/stats", self.stats)  # before the objects' catch-all
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_post("/v1/messages", self.anthropic_messages)
        self.app.router.add_post("/v1/messages/count_tokens", self.anthropic_count_tokens)
        self.objects = MockObjects(self)
        self.objects.register(self.app.router)

    # -- helpers ---------------------------------------------------------------------------
    async def _record(self, request: web.Request) -> dict:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        self.requests.append(
            {
                "path": request.path,
                "headers": dict(request.headers),
                "body": body,
                "at": time.perf_counter(),
            }
        )
        return body

    def _failure(self) -> web.Response | None:
        if self.behaviour.fail_statuses:
            status = self.behaviour.fail_statuses.pop(0)
            headers = (
                {"retry-after": self.behaviour.retry_after} if self.behaviour.retry_after else {}
            )
            return web.json_response(
                {
                    "error": {
                        "message": f"mock failure {status}",
                        "type": "mock_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=status,
                headers=headers,
            )
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
        return {
            "prompt_tokens": b.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": b.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": b.cached_tokens},
        }

    def _first_delay(self) -> float:
        """The wait before a chat answer's first event: the slow one for a seeded share."""
        b = self.behaviour
        if b.slow_share > 0 and self._rng.random() < b.slow_share:
            self.slow_firsts += 1
            return b.slow_first_delay_s
        return b.first_delay_s

    async def stats(self, request: web.Request) -> web.Response:
        """What this mock served, for benches that count upstream requests per variant."""
        return web.json_response(
            {
                "chat_requests": self.chat_requests,
                "slow_firsts": self.slow_firsts,
                "disconnects": len(self.disconnects),
            }
        )

    # -- OpenAI ----------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        self.chat_requests += 1
        failure = self._failure()
        if failure is not None:
            return failure
        b = self.behaviour
        first_delay_s = self._first_delay()
        model = body.get("model", "mock")
        words = [f"tok{i} " for i in range(b.chunks)]
        if not body.get("stream"):
            if await self._client_left_during(request, first_delay_s + b.gap_s * b.chunks):
                return web.Response(status=499)
            message: dict = {"role": "assistant", "content": "".join(words)}
            finish = "stop"
            if b.tool_call:
                message = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                }
                finish = "tool_calls"
            return web.json_response(
                {
                    "id": "chatcmpl-mock",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": self._usage(b.chunks),
                    "x_unknown_field": {"kept": True},
                },
                headers=b.answer_headers,
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **b.answer_headers})
        await resp.prepare(request)
        base = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return (
                b"data: "
                + orjson.dumps(
                    {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                )
                + b"\n\n"
            )

        try:
            await asyncio.sleep(first_delay_s)
            if b.cut_before_events:
                request.transport.close()
                return resp
            await resp.write(chunk({"role": "assistant", "content": ""}))
            if b.tool_call:
                await resp.write(
                    chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": "get_weather", "arguments": ""},
                                }
                            ]
                        }
                    )
                )
                for part in ('{"city":', '"Paris"}'):
                    await resp.write(
                        chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
                    )
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
                await resp.write(
                    b"data: "
                    + orjson.dumps({**base, "choices": [], "usage": self._usage(b.chunks)})
                    + b"\n\n"
                )
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
        base = {
            "id": "cmpl-mock",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "mock"),
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "text": "hello world",
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                    ],
                    "usage": self._usage(2),
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(b.first_delay_s)
        for text in ("hello", " world"):
            await resp.write(
                b"data: "
                + orjson.dumps(
                    {
                        **base,
                        "choices": [
                            {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
                        ],
                    }
                )
                + b"\n\n"
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                b"data: " + orjson.dumps({**base, "choices": [], "usage": self._usage(2)}) + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        if "anthropic-version" in request.headers:  # Anthropic's shape of the same list
            return web.json_response(
                {
                    "data": [
                        {
                            "type": "model",
                            "id": "claude-mock-4",
                            "display_name": "Claude Mock 4",
                            "created_at": "2025-05-22T00:00:00Z",
                        }
                    ],
                    "has_more": False,
                }
            )
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "mock"}],
            }
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return web.json_response(
            {
                "object": "list",
                "model": body.get("model"),
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        )

    # -- Anthropic -------------------------------------------------------------------------
    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        usage = {
            "input_tokens": 5,
            "output_tokens": 1,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 20,
        }
        if not body.get("stream"):
            content: list[dict] = [{"type": "text", "text": "Hello from Claude"}]
            if body.get("tools"):
                content.append(
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                )
            return web.json_response(
                {
                    "id": "msg_mock",
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": content,
                    "stop_reason": "tool_use" if body.get("tools") else "end_turn",
                    "stop_sequence": None,
                    "usage": {**usage, "output_tokens": 4},
                },
                headers=self.behaviour.answer_headers,
            )
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", **self.behaviour.answer_headers}
        )
        await resp.prepare(request)

        async def event(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n")

        await asyncio.sleep(self.behaviour.first_delay_s)
        await event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_mock",
                    "type": "message",
                    "role": "assistant",
                    "model": body["model"],
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage,
                },
            },
        )
        await event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        await event("ping", {"type": "ping"})
        for text in ("Hello", " from", " Claude"):
            await event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": text},
                },
            )
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        if body.get("tools"):
            await event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 1,
                    "content_block": {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {},
                    },
                },
            )
            for part in ('{"city": ', '"Paris"}'):
                await event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 1,
                        "delta": {"type": "input_json_delta", "partial_json": part},
                    },
                )
            await event("content_block_stop", {"type": "content_block_stop", "index": 1})
        stop = "tool_use" if body.get("tools") else "end_turn"
        await event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 3},
            },
        )
        await event("message_stop", {"type": "message_stop"})
        return resp

    async def anthropic_count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's token count: here, one token per 4 bytes of the messages' JSON."""
        body = await self._record(request)
        failure = self._failure()
        if failure is not None:
            return failure
        counted = orjson.dumps(body.get("messages", []))
        return web.json_response(
            {"input_tokens": max(1, len(counted) // 4)}, headers=self.behaviour.answer_headers
        )


# -- Objects: files, batches, stored responses ----------------------------------------------
class MockObjects:
    """Just enough of OpenAI's object endpoints for the passthrough and tenant-ownership tests:
    files (create, list, get, delete, content), batches (create, get, list, cancel), responses
    (create streamed or not, get, delete, input_items). One account: every object is visible to
    every caller, as upstream. Any other path is recorded and answered 404, so a test can assert
    what reached the upstream (`raw_path` is the request target exactly as received)."""

    def __init__(self, upstream: MockUpstream) -> None:
        self.upstream = upstream
        self.files: dict[str, dict] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict] = {}
        self.responses: dict[str, dict] = {}
        self.inputs: dict[str, list] = {}
        self._ids = 0

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/files", self.create_file)
        router.add_get("/v1/files", self.list_files)
        router.add_get("/v1/files/{id}", self.get_file)
        router.add_delete("/v1/files/{id}", self.delete_file)
        router.add_get("/v1/files/{id}/content", self.file_content)
        router.add_post("/v1/batches", self.create_batch)
        router.add_get("/v1/batches", self.list_batches)
        router.add_get("/v1/batches/{id}", self.get_batch)
        router.add_post("/v1/batches/{id}/cancel", self.get_batch)
        router.add_post("/v1/responses", self.create_response)
        router.add_get("/v1/responses/{id}", self.get_response)
        router.add_delete("/v1/responses/{id}", self.delete_response)
        router.add_get("/v1/responses/{id}/input_items", self.input_items)
        router.add_route("*", "/{tail:.*}", self.unknown)

    @property
    def behaviour(self) -> MockBehaviour:
        return self.upstream.behaviour

    def _new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids:06d}{int(time.time() * 1000) % 100000:05d}"

    async def _record(self, request: web.Request) -> bytes:
        raw = await request.read()
        self.upstream.requests.append(
            {
                "path": request.path,
                "raw_path": request.raw_path,
                "method": request.method,
                "headers": dict(request.headers),
                "body": raw,
            }
        )
        return raw

    async def _gate(self, request: web.Request) -> web.StreamResponse | None:
        """Redirect or hang as scripted; None lets the handler answer."""
        b = self.behaviour
        if b.redirect_to:
            raise web.HTTPTemporaryRedirect(b.redirect_to.rstrip("/") + request.path_qs[3:])
        if b.hang_s and await self.upstream._client_left_during(request, b.hang_s):
            return web.Response(status=499)
        return None

    def _json(self, obj: dict, status: int = 200) -> web.Response:
        return web.json_response(obj, status=status, headers=self.behaviour.object_headers)

    def _missing(self, what: str) -> web.Response:
        return self._json(
            {
                "error": {
                    "message": f"No such {what}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
            404,
        )

    def _list(self, items: list[dict]) -> web.Response:
        body: dict = {
            "object": "list",
            "data": items,
            "has_more": False,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
        }
        if self.behaviour.pad_bytes:
            body["padding"] = "x" * self.behaviour.pad_bytes
        return self._json(body)

    async def unknown(self, request: web.Request) -> web.Response:
        await self._record(request)
        return self._missing("path")

    # files
    async def create_file(self, request: web.Request) -> web.StreamResponse:
        self.upstream.requests.append(
            {
                "path": request.path,
                "raw_path": request.raw_path,
                "method": "POST",
                "headers": dict(request.headers),
                "body": b"",
            }
        )
        form = await request.post()
        gated = await self._gate(request)
        if gated is not None:
            return gated
        upload = form.get("file")
        content = upload.file.read() if hasattr(upload, "file") else str(upload or "").encode()
        self.upstream.requests[-1]["body"] = content
        filename = getattr(upload, "filename", "upload")
        if "anthropic-version" in request.headers:  # Anthropic's Files API
            file_id = self._new_id("file_011CNha")
            self.files[file_id] = {
                "id": file_id,
                "type": "file",
                "filename": filename,
                "mime_type": getattr(upload, "content_type", "application/octet-stream"),
                "size_bytes": len(content),
                "created_at": "2025-04-14T00:00:00Z",
                "downloadable": False,
            }
        else:
            file_id = self._new_id("file-")
            self.files[file_id] = {
                "id": file_id,
                "object": "file",
                "bytes": len(content),
                "created_at": int(time.time()),
                "filename": filename,
                "purpose": str(form.get("purpose", "")),
                "status": "processed",
            }
        self.contents[file_id] = content
        return self._json(self.files[file_id])

    async def list_files(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        gated = await self._gate(request)
        if gated is None and "anthropic-version" in request.headers:
            items = [f for f in self.files.values() if f.get("type") == "file"]
            first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
            return self._json(
                {"data": items, "first_id": first, "last_id": last, "has_more": False}
            )
        return gated or self._list(list(self.files.values()))

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        gated = await self._gate(request)
        found = self.files.get(request.match_info["id"])
        return gated or (self._json(found) if found else self._missing_for(request))

    async def delete_file(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        file_id = request.match_info["id"]
        if self.files.pop(file_id, None) is None:
            return self._missing_for(request)
        self.contents.pop(file_id, None)
        if "anthropic-version" in request.headers:
            return self._json({"id": file_id, "type": "file_deleted"})
        return self._json({"id": file_id, "object": "file", "deleted": True})

    def _missing_for(self, request: web.Request) -> web.Response:
        """A missing file in the caller's provider's error shape."""
        if "anthropic-version" not in request.headers:
            return self._missing("file")
        error = {"type": "not_found_error", "message": "File not found."}
        return self._json({"type": "error", "error": error}, 404)

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        file_id = request.match_info["id"]
        if file_id not in self.contents:
            return self._missing("file")
        return web.Response(
            body=self.contents[file_id],
            content_type="application/octet-stream",
            headers=self.behaviour.object_headers,
        )

    # batches: complete at once, with an output file
    async def create_batch(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await self._record(request) or b"{}")
        gated = await self._gate(request)
        if gated is not None:
            return gated
        if body.get("input_file_id") not in self.files:
            return self._missing("input file")
        output = self._new_id("file-")
        self.contents[output] = b'{"custom_id": "1", "response": {"status_code": 200}}\n'
        self.files[output] = {
            "id": output,
            "object": "file",
            "bytes": len(self.contents[output]),
            "created_at": int(time.time()),
            "filename": "batch_output.jsonl",
            "purpose": "batch_output",
            "status": "processed",
        }
        batch_id = self._new_id("batch_")
        self.batches[batch_id] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body.get("endpoint"),
            "input_file_id": body.get("input_file_id"),
            "completion_window": "24h",
            "status": "completed",
            "output_file_id": output,
            "error_file_id": None,
            "created_at": int(time.time()),
            "metadata": body.get("metadata"),
        }
        return self._json(self.batches[batch_id])

    async def get_batch(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        found = self.batches.get(request.match_info["id"])
        return self._json(found) if found else self._missing("batch")

    async def list_batches(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return self._list(list(self.batches.values()))

    # responses
    def _response(self, body: dict, response_id: str, status: str) -> dict:
        """A Responses object; with function tools and no tool result yet, a function call."""
        b = self.upstream.behaviour
        output: list[dict] = []
        if status == "completed":
            if _wants_function_call(body):
                output.append(
                    {
                        "type": "function_call",
                        "id": "fc_" + response_id,
                        "call_id": "call_1",
                        "name": "get_weather",
                        "arguments": '{"city":"Paris"}',
                        "status": "completed",
                    }
                )
            else:
                output.append(
                    {
                        "type": "message",
                        "id": "msg_" + response_id,
                        "status": "completed",
                        "role": "assistant",
                        "content": [
                            {"type": "output_text", "text": RESPONSE_TEXT, "annotations": []}
                        ],
                    }
                )
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": body.get("model"),
            "previous_response_id": body.get("previous_response_id"),
            "output": output,
            "usage": {
                "input_tokens": b.prompt_tokens,
                "input_tokens_details": {"cached_tokens": b.cached_tokens},
                "output_tokens": 4,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": b.prompt_tokens + 4,
            },
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": body.get("tools") or [],
        }

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await self._record(request) or b"{}")
        if self.behaviour.redirect_to:
            return await self._gate(request)
        response_id = self._new_id("resp_")
        self.inputs[response_id] = [body.get("input")]
        if not body.get("stream"):
            gated = await self._gate(request)
            if gated is not None:
                return gated
            self.responses[response_id] = self._response(body, response_id, "completed")
            return self._json(self.responses[response_id])
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", **self.behaviour.object_headers}
        )
        await resp.prepare(request)
        sequence = iter(range(1 << 30))

        async def event(name: str, data: dict) -> None:
            payload = {"type": name, "sequence_number": next(sequence), **data}
            await resp.write(
                f"event: {name}\n".encode() + b"data: " + orjson.dumps(payload) + b"\n\n"
            )

        try:
            await event(
                "response.created", {"response": self._response(body, response_id, "in_progress")}
            )
            if self.behaviour.hang_s and await self.upstream._client_left_during(
                request, self.behaviour.hang_s
            ):
                return resp
            await asyncio.sleep(self.behaviour.first_delay_s)
            if self.behaviour.huge_event_bytes:
                await event(
                    "response.output_text.delta", {"delta": "x" * self.behaviour.huge_event_bytes}
                )
            final = self._response(body, response_id, "completed")
            item = final["output"][0]
            at = {"output_index": 0, "item_id": item["id"]}
            await event("response.output_item.added", {"output_index": 0, "item": _started(item)})
            if item["type"] == "function_call":
                for part in ('{"city":', '"Paris"}'):
                    await event("response.function_call_arguments.delta", {**at, "delta": part})
                await event(
                    "response.function_call_arguments.done", {**at, "arguments": item["arguments"]}
                )
            else:
                part = {"type": "output_text", "text": "", "annotations": []}
                at_part = {**at, "content_index": 0}
                await event("response.content_part.added", {**at_part, "part": part})
                for word in RESPONSE_WORDS:
                    await event(
                        "response.output_text.delta", {**at_part, "delta": word, "logprobs": []}
                    )
                await event(
                    "response.output_text.done", {**at_part, "text": RESPONSE_TEXT, "logprobs": []}
                )
                await event("response.content_part.done", {**at_part, "part": item["content"][0]})
            await event("response.output_item.done", {"output_index": 0, "item": item})
            self.responses[response_id] = final
            await event("response.completed", {"response": final})
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.upstream.disconnects.append(time.perf_counter())
            raise
        return resp

    async def get_response(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        found = self.responses.get(request.match_info["id"])
        return self._json(found) if found else self._missing("response")

    async def delete_response(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        response_id = request.match_info["id"]
        if self.responses.pop(response_id, None) is None:
            return self._missing("response")
        return self._json({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        response_id = request.match_info["id"]
        if response_id not in self.responses:
            return self._missing("response")
        items = [
            {
                "id": f"msg_in_{response_id}",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": str(x)}],
            }
            for x in self.inputs.get(response_id, [])
        ]
        return self._list(items)


RESPONSE_WORDS = ("Hello", " from", " the mock")
RESPONSE_TEXT = "".join(RESPONSE_WORDS)


def _wants_function_call(body: dict) -> bool:
    """Function tools offered and no tool result in the input yet."""
    tools = body.get("tools") or []
    if not any(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        return False
    items = body.get("input")
    if not isinstance(items, list):
        return True
    return not any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)


def _started(item: dict) -> dict:
    """An output item as `response.output_item.added` shows it: in progress, nothing in it."""
    if item["type"] == "function_call":
        return {**item, "arguments": "", "status": "in_progress"}
    return {**item, "content": [], "status": "in_progress"}


class ThreadedServer:
    """Runs an aiohttp app on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, mock: MockUpstream, port: int = 0) -> None:
        self.mock = mock
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> ThreadedServer:
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
    parser.add_argument(
        "--slow-share", type=float, default=0.0, help="share of chat requests with a slow first"
    )
    parser.add_argument("--slow-first-ms", type=float, default=2000, help="their first token")
    parser.add_argument("--seed", type=int, default=0, help="seeds which requests are slow")
    args = parser.parse_args()
    mock = MockUpstream(
        MockBehaviour(
            first_delay_s=args.first_ms / 1000,
            chunks=args.chunks,
            gap_s=args.gap_ms / 1000,
            slow_share=args.slow_share,
            slow_first_delay_s=args.slow_first_ms / 1000,
        ),
        seed=args.seed,
    )
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
