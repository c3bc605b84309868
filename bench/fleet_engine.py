"""A prefix-caching inference engine, mocked over HTTP for `bench/fleet_http.py`.

    python -m bench.fleet_engine --port 9000 --name e0 [--slots 8] [--cache-blocks 2000]
                                 [--base-ms 20] [--per-token-ms 0.25] [--chunks 16] [--gap-ms 40]

What matters to a router is modelled, nothing else: the prompt is words (one word, one token),
cut into 16-token blocks hashed as a chain (a block's hash covers all before it, as vLLM's and
SGLang's do); a bounded LRU of blocks (smaller than the bench's working set) is the prefix
cache; `--slots` requests run at once and the rest queue. A request's first token comes
`base + per_token * uncached tokens` ms after it gets a slot (plus `extra_ms`, which
`POST /control {"extra_ms": 300}` sets mid-run: a replica turning slower), then `--chunks`
content chunks `--gap-ms` apart; its slot is held until the last. The first content chunk
names the engine (the bench tells where each turn landed from the answer itself).

`GET /metrics` is vLLM's (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, what `gateway/upstreams/replicas/server_load.py` reads); `GET
/stats` counts prompt and cached tokens; a prompt containing `POISON` is answered 500 (an error
that one tenant's bodies cause), one without messages 400.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import OrderedDict
from collections.abc import Container

import orjson
from aiohttp import web

BLOCK_TOKENS = 16


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.name
        self.slots = asyncio.Semaphore(args.slots)
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = args.cache_blocks
        self.base_ms, self.per_token_ms = args.base_ms, args.per_token_ms
        self.chunks, self.gap_s = args.chunks, args.gap_ms / 1000
        self.extra_ms = 0.0
        self.running = self.waiting = 0
        self.held_blocks = 0  # KV blocks the running requests hold (vLLM's usage counts these)
        # uncached_system_tokens: the uncached part within the system message (a tenant's prompt
        # recomputed here), the rest of the uncached being the conversation's own
        self.stats = {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "uncached_system_tokens": 0,
            "errors": 0,
        }

    def _insert(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            if block in self.cache:
                self.cache.move_to_end(block)
            else:
                self.cache[block] = None
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "messages is required")
        text = prompt_text(messages)
        if "POISON" in text:
            self.stats["errors"] += 1
            return _error(500, "the prompt failed validation")
        words = text.split()
        system = messages[0] if messages[0].get("role") == "system" else {}
        system_words = 1 + len(str(system.get("content", "")).split()) if system else 0
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await self._answer(request, words, system_words, _answer_shape(body))
        finally:
            self.running -= 1
            self.slots.release()

    async def _answer(
        self,
        request: web.Request,
        words: list[str],
        system_words: int,
        shape: tuple[bool, int],
    ) -> web.StreamResponse:
        blocks = block_chain(words)
        self.held_blocks += len(blocks)
        try:
            return await self._stream(request, words, blocks, system_words, *shape)
        finally:
            self.held_blocks -= len(blocks)

    async def _stream(
        self,
        request: web.Request,
        words: list[str],
        blocks: list[int],
        system_words: int,
        stream: bool = True,
        chunks: int | None = None,
    ) -> web.StreamResponse:
        chunks = self.chunks if chunks is None else min(self.chunks, chunks)
        cached = held_prefix(blocks, self.cache) * BLOCK_TOKENS
        self.stats["uncached_system_tokens"] += max(0, system_words - cached)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(words)
        self.stats["cached_tokens"] += cached
        delay_ms = self.base_ms + self.extra_ms + self.per_token_ms * (len(words) - cached)
        await asyncio.sleep(delay_ms / 1000)
        self._insert(blocks)
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": chunks,
            "total_tokens": len(words) + chunks,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        created = int(time.time())
        if not stream:
            await asyncio.sleep(self.gap_s * max(0, chunks - 1))
            text = "".join(answer_chunks(self.name, chunks)).rstrip()
            return web.json_response(_completion(created, text, usage))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for content in answer_chunks(self.name, chunks):
            await resp.write(_chunk(created, {"content": content}, None))
            await asyncio.sleep(self.gap_s)
        await resp.write(_chunk(created, {}, "stop", usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        usage = min(1.0, self.held_blocks / self.capacity)
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def control(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if "extra_ms" in body:
            self.extra_ms = float(body["extra_ms"])
        if body.get("reset"):
            self.cache.clear()
            self.stats = dict.fromkeys(self.stats, 0)
        return web.json_response({"extra_ms": self.extra_ms})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "running": self.running, "waiting": self.waiting})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


def prompt_text(messages: list[dict]) -> str:
    """The prompt as this engine reads it: each message opened by its role. Its tokens are its
    words (`.split()`; `bench/fleet_http.py` replays prompts with it)."""
    return " ".join(f"<{m.get('role')}> {m.get('content', '')}" for m in messages)


def block_chain(words: list[str]) -> list[int]:
    """The prompt's whole 16-token blocks, each hash covering every block before it."""
    out, h = [], 0
    for start in range(0, len(words) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, *words[start : start + BLOCK_TOKENS]))
        out.append(h)
    return out


def held_prefix(blocks: list[int], held: Container[int]) -> int:
    """How many of `blocks` a cache holding `held` serves: the leading ones, up to the first
    it lacks (a block's hash covers everything before it, so nothing after a miss can hit)."""
    n = 0
    for block in blocks:
        if block not in held:
            break
        n += 1
    return n


def answer_chunks(name: str, chunks: int) -> list[str]:
    """The content of an answer of `chunks` tokens from engine `name`: the name first, so that
    a client tells where its request landed from the answer itself."""
    return [f"{name} " if i == 0 else f"tok{i} " for i in range(chunks)]


def _chunk(created: int, delta: dict, finish: str | None, usage: dict | None = None) -> bytes:
    event = {
        "id": "chatcmpl-fleet",
        "object": "chat.completion.chunk",
        "created": created,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _completion(created: int, text: str, usage: dict) -> dict:
    return {
        "id": "chatcmpl-fleet",
        "object": "chat.completion",
        "created": created,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        ],
        "usage": usage,
    }


def _answer_shape(body: dict) -> tuple[bool, int | None]:
    """Whether to stream, and how many tokens to answer (`max_tokens`, as vLLM honours it;
    None: the engine's `--chunks`)."""
    limit = body.get("max_tokens")
    tokens = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    return body.get("stream", False) is not False, tokens


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=2000)
    parser.add_argument("--base-ms", type=float, default=20.0)
    parser.add_argument("--per-token-ms", type=float, default=0.25)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--gap-ms", type=float, default=40.0)
    args = parser.parse_args()
    engine = Engine(args)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", engine.chat)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/stats", engine.get_stats)
    app.router.add_post("/control", engine.control)
    app.router.add_get("/health", engine.health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
