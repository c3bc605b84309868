"""A loopback fake of a vLLM prefill server and decode server (NixlConnector's wire format).

The prefill fake checks step 1 the way vLLM's disaggregated proxies build it (exactly the six
`kv_transfer_params` fields, `stream: false`, one token, no `stream_options`/`min_tokens`, an
`X-Request-Id`) and answers a one-token completion whose `kv_transfer_params` name itself. The
decode fake checks that step 3 carries exactly what the prefill answered for the same request
id, or no `kv_transfer_params` at all (a colocated request), then answers. A request that
breaks the format is answered 400 and kept in `violations`, which every test asserts empty.

Either can be scripted (`Script`) to answer an error, wait, leave out the params, or die
mid-stream, and made to fail the router's probes (`models_status`); `Ledger` keeps, across
servers, what happened in which order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

EXPECTED_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TOKENS = ["tok0 ", "tok1 ", "tok2 ", "tok3 ", "tok4 "]
ANSWER = "".join(TOKENS)


@dataclass
class Script:
    """How one request (or every request, as `FakeServer.always`) is answered."""

    status: int = 200
    delay_s: float = 0.0  # prefill: before the answer; decode: before the first chunk
    no_params: bool = False  # prefill: answer `kv_transfer_params: null` (no KV connector)
    die_after: int | None = None  # decode: drop the connection after this many chunks
    remote_only: bool = False  # decode: `status` only for requests with kv_transfer_params


@dataclass
class Step:
    role: str
    server: str
    request_id: str | None
    at: float
    remote: bool = False  # decode: carried kv_transfer_params
    body: dict = field(default_factory=dict)


@dataclass
class Ledger:
    """What both pools saw, in order, and the params each prefill handed out."""

    steps: list[Step] = field(default_factory=list)
    answered: dict[str, float] = field(default_factory=dict)  # request id -> prefill answer
    issued: dict[str, dict] = field(default_factory=dict)  # request id -> kv_transfer_params

    def for_request(self, request_id: str) -> list[Step]:
        return [s for s in self.steps if s.request_id == request_id]

    def decodes(self) -> list[Step]:
        return [s for s in self.steps if s.role == "decode"]

    def prefills(self) -> list[Step]:
        return [s for s in self.steps if s.role == "prefill"]


class FakeServer:
    """One vLLM server in the `prefill` or `decode` role; `.app` for `ThreadedServer`."""

    def __init__(self, role: str, name: str, ledger: Ledger) -> None:
        assert role in ("prefill", "decode")
        self.role = role
        self.name = name
        self.ledger = ledger
        self.scripts: deque[Script] = deque()
        self.always: Script | None = None
        self.violations: list[str] = []
        self.disconnects: list[str | None] = []  # request ids whose client left mid-request
        self.models_status = 200  # what `GET /v1/models` (the router's probe) answers
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.handle)
        self.app.router.add_post("/v1/completions", self.handle)
        self.app.router.add_get("/v1/models", self.models)

    def script(self, script: Script, times: int = 1) -> None:
        self.scripts.extend([script] * times)

    def _next(self) -> Script:
        if self.scripts:
            return self.scripts.popleft()
        return self.always or Script()

    def posts(self) -> list[Step]:
        return [s for s in self.ledger.steps if s.server == self.name]

    async def models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return _error(self.models_status, f"scripted {self.models_status}")
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        request_id = request.headers.get("X-Request-Id")
        step = Step(self.role, self.name, request_id, time.perf_counter(), body=body)
        step.remote = "kv_transfer_params" in body
        self.ledger.steps.append(step)
        script = self._next()
        if self.role == "prefill":
            return await self._prefill(request, body, request_id, script)
        return await self._decode(request, body, request_id, script)

    # -- prefill ----------------------------------------------------------------------------

    def _check_prefill(self, body: dict, request_id: str | None) -> list[str]:
        wrong = []
        params = body.get("kv_transfer_params")
        if params != EXPECTED_PREFILL_PARAMS:
            wrong.append(f"prefill kv_transfer_params {params!r}")
        if body.get("stream") is not False:
            wrong.append(f"prefill stream {body.get('stream')!r}")
        if body.get("max_tokens") != 1:
            wrong.append(f"prefill max_tokens {body.get('max_tokens')!r}")
        if "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
            wrong.append("prefill max_completion_tokens not 1")
        for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
            if dropped in body:
                wrong.append(f"prefill carries {dropped}")
        if not request_id:
            wrong.append("prefill without X-Request-Id")
        return wrong

    async def _prefill(
        self, request: web.Request, body: dict, request_id: str | None, script: Script
    ) -> web.StreamResponse:
        wrong = self._check_prefill(body, request_id)
        if wrong:
            self.violations.extend(wrong)
            return _error(400, "; ".join(wrong))
        if script.delay_s and await self._client_left_during(request, script.delay_s, request_id):
            return _error(499, "client left")
        if script.status != 200:
            return _error(script.status, f"scripted {script.status}")
        answer = _completion(request.path, body, "tok0 ", finish="length")
        if script.no_params:
            answer["kv_transfer_params"] = None  # what a vLLM without a KV connector answers
        else:
            assert request_id is not None
            port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3],
                "remote_engine_id": f"engine-{self.name}",
                "remote_host": "127.0.0.1",
                "remote_port": port,
                "remote_request_id": request_id,
                "tp_size": 1,
            }
            answer["kv_transfer_params"] = params
            self.ledger.issued[request_id] = params
        if request_id is not None:
            self.ledger.answered[request_id] = time.perf_counter()
        return web.json_response(answer)

    # -- decode -----------------------------------------------------------------------------

    def _check_decode(self, body: dict, request_id: str | None) -> list[str]:
        wrong = []
        if not request_id:
            wrong.append("decode without X-Request-Id")
        if "kv_transfer_params" in body:
            params = body["kv_transfer_params"]
            issued = self.ledger.issued.get(request_id or "")
            if issued is None or params != issued:
                wrong.append(f"decode kv_transfer_params {params!r} != issued {issued!r}")
            if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
                wrong.append("decode without do_remote_prefill: true")
        return wrong

    async def _decode(
        self, request: web.Request, body: dict, request_id: str | None, script: Script
    ) -> web.StreamResponse:
        wrong = self._check_decode(body, request_id)
        if wrong:
            self.violations.extend(wrong)
            return _error(400, "; ".join(wrong))
        if script.status != 200 and (not script.remote_only or "kv_transfer_params" in body):
            return _error(script.status, f"scripted {script.status}")
        if script.delay_s and await self._client_left_during(request, script.delay_s, request_id):
            return _error(499, "client left")
        if not body.get("stream"):
            return web.json_response(_completion(request.path, body, ANSWER, finish="stop"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("/chat/completions")
        for i, token in enumerate(TOKENS):
            if script.die_after is not None and i >= script.die_after:
                assert request.transport is not None
                request.transport.close()  # the server dies: no final chunk, no [DONE]
                return resp
            await resp.write(_sse(_chunk(chat, body, token, None)))
            await asyncio.sleep(0.005)
        await resp.write(_sse(_chunk(chat, body, "", "stop")))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _client_left_during(
        self, request: web.Request, seconds: float, request_id: str | None
    ) -> bool:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            transport = request.transport
            if transport is None or transport.is_closing():
                self.disconnects.append(request_id)
                return True
            await asyncio.sleep(0.01)
        return False


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "server_error", "code": status}}, status=status
    )


def _completion(path: str, body: dict, text: str, finish: str) -> dict[str, Any]:
    usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    if path.endswith("/chat/completions"):
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "m"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": body.get("model", "m"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        "usage": usage,
    }


def _chunk(chat: bool, body: dict, token: str, finish: str | None) -> dict:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": token}, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": token, "finish_reason": finish}
        kind = "text_completion"
    return {
        "id": "chatcmpl-fake",
        "object": kind,
        "created": 0,
        "model": body.get("model", "m"),
        "choices": [choice],
    }


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
