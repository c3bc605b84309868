"""A mock of Google's generative APIs at their wire format, for the `gemini` and `vertex` kinds.

- Gemini API: `POST /v1beta/models/{model}:generateContent` and
  `:streamGenerateContent?alt=sse` (`data: {GenerateContentResponse}` events, CRLF-framed as
  Google frames them, no end event), keyed by `x-goog-api-key`;
- Vertex AI: the same two methods under
  `/v1/projects/{p}/locations/{r}/publishers/google/models/`, and Claude's `:rawPredict` /
  `:streamRawPredict` (Anthropic's Messages answer and SSE events) under
  `publishers/anthropic/models/`, both with `Authorization: Bearer`;
- an OAuth token endpoint (`POST /token`) for a service account's JWT grant, which checks
  the assertion's RS256 signature against the account's public key and hands out
  `ya29.mock-<n>` tokens;
- errors in Google's shape: `{"error": {"code", "message", "status", "details"}}`.

The Gemini paths are matched the way Google matches them: `{model}:{method}` is one segment.
Run it alone for a bench with `python -m bench.mock_google --port 9100 --first-ms 50 --chunks 20
--gap-ms 5`: each stream is then `tok0` ... `tok19` after the first delay, a gap apart.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}
GOOGLE_STATUS |= {429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
SIGNATURE = base64.b64encode(b"thought-signature-bytes").decode()


@dataclass
class GoogleBehaviour:
    api_key: str = "gm-secret-key"
    prompt_tokens: int = 1200
    cached_tokens: int = 1024  # cachedContentTokenCount / cache_read_input_tokens
    fail_statuses: list[int] = field(default_factory=list)  # consumed one per model request
    retry_delay: str | None = None  # RetryInfo.retryDelay on a 429, e.g. "3s"
    fail_message: str = "mock failure"
    cut_before_finish: bool = False  # a stream that ends before its finishReason
    stream_error: bool = False  # an `{"error": ...}` event in the stream
    token_expires_in: int = 3600
    hold_token: asyncio.Event | None = None  # token requests after the first wait for it
    # bench mode (chunks > 0): a stream of `tok<i>` texts, the first after first_delay_s
    chunks: int = 0
    first_delay_s: float = 0.0
    gap_s: float = 0.0


class MockGoogle:
    def __init__(self, behaviour: GoogleBehaviour | None = None) -> None:
        self.behaviour = behaviour or GoogleBehaviour()
        self.requests: list[dict] = []  # model requests: path, query, headers, body
        self.tokens_issued: list[str] = []
        self.token_requests = 0  # grants received, a held one included
        self.public_key: rsa.RSAPublicKey | None = None
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)  # a readiness probe, for benches
        self.app.router.add_post("/token", self.token)
        self.app.router.add_post("/v1beta/models/{tail}", self.gemini)
        base = "/v1/projects/{project}/locations/{region}/publishers"
        self.app.router.add_post(base + "/google/models/{tail}", self.vertex_gemini)
        self.app.router.add_post(base + "/anthropic/models/{tail}", self.vertex_claude)

    def base_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"models": []})

    # -- the token endpoint ----------------------------------------------------------------
    async def token(self, request: web.Request) -> web.Response:
        form = await request.post()
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        if not self._signed(str(form.get("assertion", ""))):
            return web.json_response({"error": "invalid_grant"}, status=400)
        self.token_requests += 1
        hold = self.behaviour.hold_token
        if hold is not None and self.tokens_issued:
            await hold.wait()
        token = f"ya29.mock-{len(self.tokens_issued) + 1}"
        self.tokens_issued.append(token)
        body = {
            "access_token": token,
            "expires_in": self.behaviour.token_expires_in,
            "token_type": "Bearer",
        }
        return web.json_response(body)

    def _signed(self, assertion: str) -> bool:
        """The JWT is RS256-signed by the service account's key (what google-auth does)."""
        if self.public_key is None or assertion.count(".") != 2:
            return False
        head, claims, signature = assertion.split(".")
        try:
            self.public_key.verify(
                _b64url(signature), f"{head}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except Exception:  # noqa: BLE001  # any failure: not signed by this key
            return False
        return True

    # -- model requests --------------------------------------------------------------------
    async def _record(self, request: web.Request) -> dict:
        body = orjson.loads(await request.read())
        self.requests.append(
            {
                "path": request.path,
                "query": request.query_string,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": body,
            }
        )
        return body

    def _failure(self) -> web.Response | None:
        if not self.behaviour.fail_statuses:
            return None
        status = self.behaviour.fail_statuses.pop(0)
        error: dict[str, Any] = {
            "code": status,
            "message": self.behaviour.fail_message,
            "status": GOOGLE_STATUS.get(status, "UNKNOWN"),
        }
        if status == 429 and self.behaviour.retry_delay:
            error["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": self.behaviour.retry_delay,
                }
            ]
        return web.json_response({"error": error}, status=status)

    async def gemini(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if request.headers.get("x-goog-api-key") != self.behaviour.api_key:
            return _google_error(400, "API key not valid. Please pass a valid API key.")
        return await self._generate(request, body)

    async def vertex_gemini(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if not self._bearer_ok(request):
            return _google_error(401, "Request had invalid authentication credentials.")
        return await self._generate(request, body)

    def _bearer_ok(self, request: web.Request) -> bool:
        auth = request.headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in self.tokens_issued

    async def _generate(self, request: web.Request, body: dict) -> web.StreamResponse:
        model, _, method = request.match_info["tail"].partition(":")
        failure = self._failure()
        if failure is not None:
            return failure
        tools = bool(body.get("tools"))
        if method == "generateContent":
            parts: list[dict] = [{"text": "Hello from Gemini"}]
            if tools:
                parts.append(_function_call())
            return web.json_response(
                {
                    "candidates": [
                        {
                            "content": {"role": "model", "parts": parts},
                            "finishReason": "STOP",
                            "index": 0,
                        }
                    ],
                    "usageMetadata": self._usage(4),
                    "modelVersion": model,
                    "responseId": "resp-mock",
                }
            )
        if method != "streamGenerateContent" or request.query.get("alt") != "sse":
            return _google_error(404, f"method {method!r} not found")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(parts: list[dict], finish: str | None = None, tokens: int = 1) -> None:
            candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
            if finish:
                candidate["finishReason"] = finish
            chunk = {
                "candidates": [candidate],
                "usageMetadata": self._usage(tokens),
                "modelVersion": model,
                "responseId": "resp-mock",
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\r\n\r\n")

        if self.behaviour.chunks:
            await asyncio.sleep(self.behaviour.first_delay_s)
            for i in range(self.behaviour.chunks):
                await event([{"text": f"tok{i}"}], tokens=i + 1)
                await asyncio.sleep(self.behaviour.gap_s)
            await event([{"text": ""}], finish="STOP", tokens=self.behaviour.chunks)
            return resp
        await event([{"text": "Hello"}])
        await event([{"text": " from"}], tokens=2)
        if self.behaviour.stream_error:
            error = {"error": {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}}
            await resp.write(b"data: " + orjson.dumps(error) + b"\r\n\r\n")
            return resp
        if self.behaviour.cut_before_finish:
            return resp
        await event([{"text": " Gemini"}], tokens=3)
        if tools:
            await event([_function_call()], tokens=4)
        await event([{"text": ""}], finish="STOP", tokens=4)
        return resp

    def _usage(self, output: int) -> dict:
        prompt = self.behaviour.prompt_tokens
        usage = {
            "promptTokenCount": prompt,
            "candidatesTokenCount": output,
            "totalTokenCount": prompt + output,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
        }
        if self.behaviour.cached_tokens:
            usage["cachedContentTokenCount"] = self.behaviour.cached_tokens
            usage["cacheTokensDetails"] = [
                {"modality": "TEXT", "tokenCount": self.behaviour.cached_tokens}
            ]
        return usage

    async def vertex_claude(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if not self._bearer_ok(request):
            return _google_error(401, "Request had invalid authentication credentials.")
        failure = self._failure()
        if failure is not None:
            return failure
        model, _, method = request.match_info["tail"].partition(":")
        if "model" in body and model != "count-tokens":
            return _anthropic_error(400, "model: Extra inputs are not permitted")
        if body.get("anthropic_version") != "vertex-2023-10-16":
            return _anthropic_error(400, "anthropic_version: vertex-2023-10-16 is required")
        if model == "count-tokens":
            return web.json_response({"input_tokens": 42})
        usage = {
            "input_tokens": 5,
            "output_tokens": 1,
            "cache_read_input_tokens": self.behaviour.cached_tokens,
            "cache_creation_input_tokens": 20,
        }
        tools = bool(body.get("tools"))
        if method == "rawPredict":
            content: list[dict] = [{"type": "text", "text": "Hello from Claude"}]
            if tools:
                content.append(_tool_use())
            message = {
                "id": "msg_vrtx_mock",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": "tool_use" if tools else "end_turn",
                "stop_sequence": None,
                "usage": {**usage, "output_tokens": 4},
            }
            return web.json_response(message)
        if method != "streamRawPredict":
            return _google_error(404, f"method {method!r} not found")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n")

        start = {"id": "msg_vrtx_mock", "type": "message", "role": "assistant", "model": model}
        start |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        await event("message_start", {"type": "message_start", "message": start})
        block = {"type": "content_block_start", "index": 0}
        await event("content_block_start", {**block, "content_block": {"type": "text", "text": ""}})
        for text in ("Hello", " from", " Claude"):
            delta = {"type": "text_delta", "text": text}
            await event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        if tools:
            tool = {**_tool_use(), "input": {}}
            await event(
                "content_block_start",
                {"type": "content_block_start", "index": 1, "content_block": tool},
            )
            delta = {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
            await event(
                "content_block_delta", {"type": "content_block_delta", "index": 1, "delta": delta}
            )
            await event("content_block_stop", {"type": "content_block_stop", "index": 1})
        stop = {"stop_reason": "tool_use" if tools else "end_turn", "stop_sequence": None}
        await event(
            "message_delta", {"type": "message_delta", "delta": stop, "usage": {"output_tokens": 3}}
        )
        await event("message_stop", {"type": "message_stop"})
        return resp


def _function_call() -> dict:
    return {
        "functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
        "thoughtSignature": SIGNATURE,
    }


def _tool_use() -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_vrtx_1",
        "name": "get_weather",
        "input": {"city": "Paris"},
    }


def _google_error(status: int, message: str) -> web.Response:
    name = {401: "UNAUTHENTICATED"}.get(status) or GOOGLE_STATUS.get(status, "UNKNOWN")
    return web.json_response(
        {"error": {"code": status, "message": message, "status": name}}, status=status
    )


def _anthropic_error(status: int, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    return web.json_response(body, status=status)


def _b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--first-ms", type=float, default=50.0)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--api-key", default=GoogleBehaviour.api_key)
    args = parser.parse_args()
    behaviour = GoogleBehaviour(
        api_key=args.api_key,
        chunks=args.chunks,
        first_delay_s=args.first_ms / 1000,
        gap_s=args.gap_ms / 1000,
    )
    mock = MockGoogle(behaviour)
    mock.requests = _Discard()
    web.run_app(mock.app, host="127.0.0.1", port=args.port, print=None, access_log=None)


class _Discard(list):
    """A standalone mock keeps no requests: a long bench would grow it without bound."""

    def append(self, item: object) -> None:
        pass


if __name__ == "__main__":
    main()
