"""An Azure OpenAI resource at its wire format, from Azure's REST reference.

- Dated API: ``POST /openai/deployments/{deployment}/chat/completions?api-version=...`` (and
  ``completions``, ``embeddings``), account paths ``/openai/files?api-version=...``; the
  ``api-version`` query is required (404 without). The v1 surface, ``/openai/v1/...``, takes
  the deployment in the body's ``model`` and no ``api-version``.
- Auth: ``api-key: <key>`` (401 with Azure's body otherwise).
- Answers: OpenAI's shapes plus Azure's content-filter annotations (``prompt_filter_results``
  on a first stream chunk with ``choices: []``, ``content_filter_results`` on choices); usage
  with ``prompt_tokens_details.cached_tokens``; errors ``{"error": {"code", "message"}}``;
  a 429 with ``retry-after`` and ``retry-after-ms``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

FILTERS = {
    "hate": {"filtered": False, "severity": "safe"},
    "self_harm": {"filtered": False, "severity": "safe"},
    "sexual": {"filtered": False, "severity": "safe"},
    "violence": {"filtered": False, "severity": "safe"},
}
PROMPT_FILTERS = [{"prompt_index": 0, "content_filter_results": FILTERS}]


@dataclass
class AzureBehaviour:
    key: str = "azure-secret"
    deployments: tuple[str, ...] = ("my-deployment", "embed-deployment", "gpt-4o")
    cached_tokens: int = 1024
    fail_429: int = 0  # this many chat requests answer 429 first
    hang_first_s: float = 0.0  # the first chat request waits this long before answering
    requests: list[dict] = field(default_factory=list)


def _error(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message}}, status=status, headers=headers
    )


class AzureMock:
    def __init__(self, behaviour: AzureBehaviour | None = None) -> None:
        self.behaviour = behaviour or AzureBehaviour()
        self.chat_calls = 0
        self.app = web.Application()
        r = self.app.router
        r.add_post("/openai/deployments/{deployment}/chat/completions", self.dated_chat)
        r.add_post("/openai/deployments/{deployment}/embeddings", self.dated_embeddings)
        r.add_get("/openai/files", self.files)
        r.add_get("/openai/models", self.models)
        r.add_post("/openai/v1/chat/completions", self.v1_chat)
        r.add_post("/openai/v1/embeddings", self.v1_embeddings)
        r.add_get("/openai/v1/models", self.models)
        r.add_route("*", "/{tail:.*}", self.not_found)

    @property
    def requests(self) -> list[dict]:
        return self.behaviour.requests

    async def _record(self, request: web.Request) -> dict:
        raw = await request.read()
        body = orjson.loads(raw) if raw else {}
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "raw_path": request.raw_path,
                "query": dict(request.query),
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
            }
        )
        return body

    def _denied(self, request: web.Request, dated: bool) -> web.Response | None:
        if request.headers.get("api-key") != self.behaviour.key:
            return _error(
                401,
                "401",
                "Access denied due to invalid subscription key or wrong API endpoint. Make sure "
                "to provide a valid key for an active subscription and use a correct regional "
                "API endpoint for your resource.",
            )
        if dated and "api-version" not in request.query:
            return _error(404, "404", "Resource not found")
        return None

    async def not_found(self, request: web.Request) -> web.Response:
        await self._record(request)
        return _error(404, "404", "Resource not found")

    async def models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"object": "list", "data": []})

    async def files(self, request: web.Request) -> web.Response:
        await self._record(request)
        denied = self._denied(request, dated=True)
        if denied is not None:
            return denied
        return web.json_response({"object": "list", "data": [], "has_more": False})

    async def dated_embeddings(self, request: web.Request) -> web.Response:
        return await self._embeddings(request, request.match_info["deployment"], dated=True)

    async def v1_embeddings(self, request: web.Request) -> web.Response:
        return await self._embeddings(request, None, dated=False)

    async def _embeddings(self, request: web.Request, deployment: str | None, dated: bool):
        body = await self._record(request)
        denied = self._denied(request, dated)
        if denied is not None:
            return denied
        name = deployment or body.get("model")
        if name not in self.behaviour.deployments:
            return _deployment_not_found()
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "model": "text-embedding-3-small",
                "usage": {"prompt_tokens": 2, "total_tokens": 2},
            }
        )

    async def dated_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, request.match_info["deployment"], dated=True)

    async def v1_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._chat(request, None, dated=False)

    def _usage(self) -> dict:
        return {
            "prompt_tokens": 1500,
            "completion_tokens": 3,
            "total_tokens": 1503,
            "prompt_tokens_details": {
                "cached_tokens": self.behaviour.cached_tokens,
                "audio_tokens": 0,
            },
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        }

    async def _chat(
        self, request: web.Request, deployment: str | None, dated: bool
    ) -> web.StreamResponse:
        body = await self._record(request)
        b = self.behaviour
        denied = self._denied(request, dated)
        if denied is not None:
            return denied
        name = deployment or body.get("model")
        if name not in b.deployments:
            return _deployment_not_found()
        self.chat_calls += 1
        if self.chat_calls == 1 and b.hang_first_s:
            await asyncio.sleep(b.hang_first_s)
        if b.fail_429 > 0:
            b.fail_429 -= 1
            return _error(
                429,
                "429",
                "Requests to the ChatCompletions_Create Operation under Azure OpenAI API version "
                "2024-10-21 have exceeded token rate limit of your current OpenAI S0 pricing tier. "
                "Please retry after 1 second.",
                headers={
                    "retry-after": "0",
                    "retry-after-ms": "10",
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-remaining-tokens": "0",
                },
            )
        tool = bool(body.get("tools"))
        head = {
            "id": "chatcmpl-azure",
            "created": int(time.time()),
            "model": "gpt-4o-2024-11-20",
            "system_fingerprint": "fp_azure",
        }
        headers = {"x-request-id": "azure-req-1", "x-ratelimit-remaining-requests": "99"}
        if not body.get("stream"):
            message: dict = {"role": "assistant", "content": "hello from azure", "refusal": None}
            finish = "stop"
            if tool:
                message = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_az",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                }
                finish = "tool_calls"
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion",
                    "prompt_filter_results": PROMPT_FILTERS,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "finish_reason": finish,
                            "logprobs": None,
                            "content_filter_results": FILTERS,
                        }
                    ],
                    "usage": self._usage(),
                },
                headers=headers,
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await resp.prepare(request)

        async def send(chunk: dict) -> None:
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")

        def chunk(delta: dict, finish: str | None = None) -> dict:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if finish is None:
                choice["content_filter_results"] = FILTERS
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        # Azure's first event: the prompt's filter results, with no choices and empty ids.
        await send(
            {
                "choices": [],
                "created": 0,
                "id": "",
                "model": "",
                "object": "",
                "prompt_filter_results": PROMPT_FILTERS,
            }
        )
        await send(chunk({"role": "assistant", "content": ""}))
        if tool:
            await send(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_az",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    }
                )
            )
            for part in ('{"city":', '"Paris"}'):
                await send(chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}))
            await send(chunk({}, "tool_calls"))
        else:
            for word in ("hello", " from", " azure"):
                await send(chunk({"content": word}))
            await send(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(
                {**head, "object": "chat.completion.chunk", "choices": [], "usage": self._usage()}
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _deployment_not_found() -> web.Response:
    return _error(
        404,
        "DeploymentNotFound",
        "The API deployment for this resource does not exist. If you created the deployment "
        "within the last 5 minutes, please wait a moment and try again.",
    )
