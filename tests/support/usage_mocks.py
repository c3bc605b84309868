"""DeepSeek and Moonshot (Kimi) chat endpoints at their wire format, as far as usage goes.

Both speak OpenAI's chat API; they differ in where the cached prompt tokens are reported:

- DeepSeek: ``usage.prompt_cache_hit_tokens`` and ``usage.prompt_cache_miss_tokens`` at the top
  level, no ``prompt_tokens_details`` (its older answers); a stream with ``include_usage`` ends
  with a ``choices: []`` chunk carrying the usage, as OpenAI's does.
- Moonshot: ``usage.cached_tokens`` at the top level. A stream puts the usage on its finish
  chunk, either on the choice (``choices[0].usage``, the moonshot-v1 streams) or beside it.
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web


class ProviderChatMock:
    """``style``: "deepseek", "moonshot" (usage on the choice) or "moonshot_top" (usage on the
    finish chunk itself)."""

    def __init__(self, style: str, prompt_tokens: int = 1100, cached_tokens: int = 1024) -> None:
        self.style = style
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.requests: list[dict] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    def usage(self, completion: int) -> dict:
        base = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.style == "deepseek":
            return {
                **base,
                "prompt_cache_hit_tokens": self.cached_tokens,
                "prompt_cache_miss_tokens": self.prompt_tokens - self.cached_tokens,
            }
        return {**base, "cached_tokens": self.cached_tokens}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append({"headers": dict(request.headers), "body": body})
        head = {
            "id": "chatcmpl-provider",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model"),
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hello there"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": self.usage(2),
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def send(chunk: dict) -> None:
            await resp.write(b"data: " + orjson.dumps({**head, **chunk}) + b"\n\n")

        def choice(delta: dict, finish: str | None = None) -> dict:
            return {"index": 0, "delta": delta, "finish_reason": finish}

        await send({"choices": [choice({"role": "assistant", "content": ""})]})
        for word in ("hello", " there"):
            await send({"choices": [choice({"content": word})]})
        finish = choice({}, "stop")
        if self.style == "deepseek":
            await send({"choices": [finish]})
            if include_usage:
                await send({"choices": [], "usage": self.usage(2)})
        elif self.style == "moonshot":
            await send({"choices": [{**finish, "usage": self.usage(2)}]})
        else:
            await send({"choices": [finish], "usage": self.usage(2)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
