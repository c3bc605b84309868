"""A loopback fake of an SGLang prefill server and decode server (PD mode, bootstrap protocol).

Both check the bootstrap fields a router adds: `bootstrap_host` is the prefill server's host,
`bootstrap_port` the port it was told to expect (SGLang's default 8998 unless set),
`bootstrap_room` a non-negative 63-bit integer. They meet in a `Ledger` room, as the real
servers meet through the prefill server's bootstrap service: the prefill fake waits (bounded)
for the decode request of its room before it "sends the KV", and the decode fake waits
(bounded) for the prefill request of its room, with the same host and port, and then for the
KV; so a router that does not send both at once breaks the exchange. A decode request without
bootstrap fields is an ordinary (colocated) one. A request that breaks the protocol is answered
400 and kept in `violations`, which every test asserts empty.

The prefill fake can be scripted to answer an error once its decode peer joined (`fail_with`:
the KV transfer failed, so the paired decode request is always there waiting for KV) or to wait
before sending the KV (`delay_s`); a decode request whose KV never comes waits (as SGLang does)
until its client leaves or `KV_WAIT_S` passes. Either fake records the rooms of requests whose
client left while it waited (`disconnects`): a router that lets a request go has closed it, one
that waited it out has not. With `Ledger.together`, no prefill fake sends KV before that many
prefill requests arrived, so that they are all in flight at once however slowly they come.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from tests.upstreams.pd.vllm_fake import ANSWER, TOKENS, _chunk, _completion, _error, _sse

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
PEER_WAIT_S = 2.0  # how long one half of a room waits for the other to arrive
KV_WAIT_S = 5.0  # how long a decode request waits for KV
TOGETHER_WAIT_S = 5.0  # how long a prefill request waits for `Ledger.together` to arrive


@dataclass
class Step:
    role: str
    server: str
    at: float
    body: dict

    @property
    def room(self) -> int | None:
        return self.body.get("bootstrap_room")

    @property
    def paired(self) -> bool:
        return "bootstrap_room" in self.body


@dataclass
class Room:
    prefill: Step | None = None
    decode: Step | None = None
    kv: str | None = None  # "sent" or "failed", once the prefill side knows


@dataclass
class Ledger:
    """What both pools saw, shared across the servers' threads."""

    steps: list[Step] = field(default_factory=list)
    rooms: dict[int, Room] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    together: int = 0  # prefill requests that must all have arrived before any sends KV

    def add(self, step: Step) -> Room | None:
        with self.lock:
            self.steps.append(step)
            if step.room is None:
                return None
            room = self.rooms.setdefault(step.room, Room())
            setattr(room, step.role, step)
            return room

    def of(self, role: str) -> list[Step]:
        with self.lock:
            return [s for s in self.steps if s.role == role]

    def paired(self) -> list[Step]:
        """The requests, of either role, that carried bootstrap fields."""
        with self.lock:
            return [s for s in self.steps if s.paired]


async def _until(check, seconds: float, request: web.Request) -> bool | None:
    """Poll `check` for `seconds`: True once it holds, False when time ran out, None when the
    client left first."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if check():
            return True
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        await asyncio.sleep(0.005)
    return False


class FakeServer:
    """One SGLang server in the `prefill` or `decode` role; `.app` for `ThreadedServer`.
    A prefill fake must be told where it is reachable (`expect`) before it is used."""

    def __init__(self, role: str, name: str, ledger: Ledger) -> None:
        assert role in ("prefill", "decode")
        self.role = role
        self.name = name
        self.ledger = ledger
        self.host: str | None = None
        self.bootstrap_port = 8998
        self.fail_with: int | None = None  # prefill: answer this status once the peer joined
        self.delay_s = 0.0  # prefill: before the KV goes
        self.violations: list[str] = []
        self.disconnects: list[int] = []  # rooms whose client left while waiting
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.handle)
        self.app.router.add_post("/v1/completions", self.handle)
        self.app.router.add_get("/v1/models", self.models)

    def expect(self, host: str, bootstrap_port: int = 8998) -> None:
        self.host, self.bootstrap_port = host, bootstrap_port

    def posts(self) -> list[Step]:
        return [s for s in self.ledger.steps if s.server == self.name]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        step = Step(self.role, self.name, time.perf_counter(), body)
        wrong = _field_errors(body, required=self.role == "prefill")
        if not wrong and self.role == "prefill":
            if (body["bootstrap_host"], body["bootstrap_port"]) != (self.host, self.bootstrap_port):
                wrong.append(
                    f"prefill {self.name} at {self.host}:{self.bootstrap_port} got "
                    f"{body['bootstrap_host']}:{body['bootstrap_port']}"
                )
        room = None if wrong else self.ledger.add(step)
        if room is not None and room.prefill is not None and room.decode is not None:
            if room.prefill.body.get("stream") != room.decode.body.get("stream"):
                wrong.append("the two servers got different requests")
        if wrong:
            self.violations.extend(wrong)
            return _error(400, "; ".join(wrong))
        if self.role == "prefill":
            assert room is not None
            return await self._prefill(request, body, room)
        return await self._decode(request, body, room)

    async def _prefill(self, request: web.Request, body: dict, room: Room) -> web.StreamResponse:
        joined = await _until(lambda: room.decode is not None, PEER_WAIT_S, request)
        if not joined:
            room.kv = "failed"
            if joined is False:
                self.violations.append(f"no decode request joined room {body['bootstrap_room']}")
                return _error(500, "no decode peer")
            self.disconnects.append(body["bootstrap_room"])
            return _error(499, "client left")
        if self.fail_with is not None:
            room.kv = "failed"
            return _error(self.fail_with, f"scripted {self.fail_with}")
        ledger = self.ledger
        together = await _until(
            lambda: len(ledger.of("prefill")) >= ledger.together, TOGETHER_WAIT_S, request
        )
        if together is False:
            came = len(ledger.of("prefill"))
            self.violations.append(f"only {came} of {ledger.together} prefill requests came")
        stayed = together is not None
        if stayed and self.delay_s:
            stayed = await _until(lambda: False, self.delay_s, request) is not None
        if not stayed:
            room.kv = "failed"
            self.disconnects.append(body["bootstrap_room"])
            return _error(499, "client left")
        room.kv = "sent"
        if not body.get("stream"):
            return web.json_response(_completion(request.path, body, TOKENS[0], "length"))
        chat = request.path.endswith("/chat/completions")
        return web.Response(
            body=_sse(_chunk(chat, body, TOKENS[0], "length")) + b"data: [DONE]\n\n",
            content_type="text/event-stream",
        )

    async def _decode(
        self, request: web.Request, body: dict, room: Room | None
    ) -> web.StreamResponse:
        if room is not None:
            arrived = await _until(lambda: room.prefill is not None, PEER_WAIT_S, request)
            if arrived is False:
                self.violations.append(f"no prefill request joined room {body['bootstrap_room']}")
                return _error(500, "no prefill peer")
            if arrived is None:
                self.disconnects.append(body["bootstrap_room"])
                return _error(499, "client left")
            assert room.prefill is not None
            theirs = {k: room.prefill.body[k] for k in FIELDS}
            if theirs != {k: body[k] for k in FIELDS}:
                self.violations.append(f"decode fields {body} != the prefill's {theirs}")
                return _error(400, "fields differ")
            kv = await _until(lambda: room.kv == "sent", KV_WAIT_S, request)
            if kv is None:
                self.disconnects.append(body["bootstrap_room"])
                return _error(499, "client left")
            if not kv:
                return _error(500, "KV transfer failed")
        if not body.get("stream"):
            return web.json_response(_completion(request.path, body, ANSWER, "stop"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("/chat/completions")
        for token in TOKENS:
            await resp.write(_sse(_chunk(chat, body, token, None)))
            await asyncio.sleep(0.005)
        await resp.write(_sse(_chunk(chat, body, "", "stop")))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _field_errors(body: dict, required: bool) -> list[str]:
    present = [k for k in FIELDS if k in body]
    if not present and not required:
        return []
    if len(present) != len(FIELDS):
        return [f"bootstrap fields {present}, not all of {list(FIELDS)}"]
    wrong = []
    room = body["bootstrap_room"]
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        wrong.append(f"bootstrap_room {room!r} is not a non-negative 63-bit integer")
    if not isinstance(body["bootstrap_port"], int):
        wrong.append(f"bootstrap_port {body['bootstrap_port']!r}")
    if not isinstance(body["bootstrap_host"], str):
        wrong.append(f"bootstrap_host {body['bootstrap_host']!r}")
    return wrong
