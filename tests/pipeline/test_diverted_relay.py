"""Past its first batch, an OpenAI-compatible stream is relayed from the upstream connection's
read callback into the client's (`StreamRelay._pump`): the client gets what the ASGI `send`
path gives it, the request is recorded the same, and a slow client pauses the upstream."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import orjson
import pytest
from aiohttp import web

import gateway.pipeline.stream_relay as stream_relay
from bench.mock_openai import ThreadedServer
from gateway.pipeline.stream_relay import StreamRelay
from gateway.telemetry.record import RequestRecord
from gateway.upstreams.base import OutEvent
from gateway.upstreams.http1 import Http1Response
from tests.ops.test_metrics_through_gateway import metrics_text
from tests.support.gateway import anthropic_route, openai_route
from tests.telemetry.prometheus_quantile import samples

KEYS = "acme:key-a"


@pytest.fixture
def diverts(monkeypatch) -> list[Http1Response]:
    """The answers diverted, in order (the gateway runs in this process)."""
    seen: list[Http1Response] = []
    divert = Http1Response.divert

    def spy(self: Http1Response, sink) -> None:
        seen.append(self)
        divert(self, sink)

    monkeypatch.setattr(Http1Response, "divert", spy)
    return seen


def events_of(body: bytes) -> list[object]:
    """The stream's events, their `created` stamp and `id` left out (each answer has its own)."""
    out: list[object] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ")
        data = block[6:]
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        event = orjson.loads(data)
        event.pop("created", None)
        event.pop("id", None)
        out.append(event)
    return out


def stream(gw, usage: bool, model: str = "mock-1") -> bytes:
    body: dict = {"model": model, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    if usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": "Bearer key-a"}
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
    ) as r:
        assert r.status_code == 200
        return r.read()


def prompt_tokens_counted(gw) -> float:
    return sum(
        s.value
        for s in samples(metrics_text(gw))
        if s.name == "firsttoken_prompt_tokens_total" and s.labels.get("tenant") == "acme"
    )


def wait_counted(gw, total: float) -> float:
    deadline = time.monotonic() + 5
    while (counted := prompt_tokens_counted(gw)) < total and time.monotonic() < deadline:
        time.sleep(0.02)
    return counted


@pytest.mark.parametrize("usage", [True, False], ids=["include_usage", "no_usage"])
def test_a_diverted_stream_reads_as_the_send_path_does(
    usage, diverts, mock_upstream, make_gateway, monkeypatch
):
    mock_upstream.mock.behaviour.chunks = 12
    mock_upstream.mock.behaviour.gap_s = 0.002
    mock_upstream.mock.behaviour.prompt_tokens = 7
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS, admin_keys="root-key")

    diverted = events_of(stream(gw, usage))
    assert len(diverts) == 1  # this answer went through the read callback
    assert wait_counted(gw, 7) == 7  # usage read from the diverted events, counted once

    monkeypatch.setattr(stream_relay, "direct_body", lambda scope: None)  # a server without it
    sent = events_of(stream(gw, usage))
    assert len(diverts) == 1  # this one through `send`
    assert wait_counted(gw, 14) == 14

    assert diverted == sent
    texts = [
        e["choices"][0]["delta"].get("content")  # type: ignore[index]
        for e in diverted
        if isinstance(e, dict) and e["choices"]
    ]
    assert "".join(t or "" for t in texts) == "".join(f"tok{i} " for i in range(12))
    assert diverted[-1] == "[DONE]"
    has_usage = [e for e in diverted if isinstance(e, dict) and e.get("usage")]
    assert len(has_usage) == (1 if usage else 0)


class HeldAnthropic:
    """An Anthropic Messages upstream that streams its answer's first events, then holds the
    rest until `release` is set: the gateway's first batch can never be the whole answer."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/messages", self.messages)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(name: str, data: dict) -> None:
            await resp.write(f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n")

        usage = {"input_tokens": 5, "output_tokens": 1}
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x"}
        await event(
            "message_start", {"type": "message_start", "message": {**message, "usage": usage}}
        )
        await self.release.wait()
        self.release.clear()
        block = {"type": "text", "text": ""}
        await event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        for text in ("Hello", " from", " Claude"):
            delta = {"type": "text_delta", "text": text}
            await event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3},
        }
        await event("message_delta", end)
        await event("message_stop", {"type": "message_stop"})
        return resp


def held_stream(gw, upstream: ThreadedServer, mock: HeldAnthropic) -> list[object]:
    """The chat door's stream of the held answer, the rest released once its first event is in."""
    body = {"model": "claude-x", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    headers = {"authorization": "Bearer key-a"}
    lines = []
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
    ) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line.encode())
                if len(lines) == 1:
                    upstream.call(mock.release.set)
    return events_of(b"\n\n".join(lines) + b"\n\n")


def test_a_translated_stream_is_diverted_too(diverts, make_gateway, monkeypatch):
    """An Anthropic answer to the chat door: its events are translated in the read callback, as
    `__aiter__` translates them."""
    mock = HeldAnthropic()
    with ThreadedServer(mock) as upstream:  # type: ignore[arg-type]
        gw = make_gateway([anthropic_route(upstream)], tenant_keys=KEYS)
        diverted = held_stream(gw, upstream, mock)
        assert len(diverts) == 1
        monkeypatch.setattr(stream_relay, "direct_body", lambda scope: None)
        sent = held_stream(gw, upstream, mock)
        assert len(diverts) == 1
    assert diverted == sent
    texts = [
        e["choices"][0]["delta"].get("content")  # type: ignore[index]
        for e in diverted
        if isinstance(e, dict) and e.get("choices")
    ]
    assert "".join(t or "" for t in texts) == "Hello from Claude"
    assert diverted[-1] == "[DONE]"


def test_an_answer_cut_after_its_first_events_ends_with_an_error_then_done(
    diverts, mock_upstream, make_gateway
):
    mock_upstream.mock.behaviour.chunks = 8
    mock_upstream.mock.behaviour.die_after_chunks = 4
    gw = make_gateway([openai_route(mock_upstream)], tenant_keys=KEYS)
    events = events_of(stream(gw, usage=False))
    assert len(diverts) == 1
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and "error" in error
    texts = [e["choices"][0]["delta"].get("content") for e in events[:-2] if isinstance(e, dict)]
    assert "tok3 " in texts and "tok4 " not in texts


class ErrorThenMore:
    """An OpenAI-compatible upstream whose first read ends in an in-stream error event, with
    content after it a little later: nothing after the error may reach the client."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        error = {"error": {"message": "overloaded", "type": "server_error"}}
        await resp.write(
            b"data: " + orjson.dumps(role) + b"\n\ndata: " + orjson.dumps(error) + b"\n\n"
        )
        await asyncio.sleep(0.05)
        more = {"choices": [{"index": 0, "delta": {"content": "smuggled"}}]}
        await resp.write(b"data: " + orjson.dumps(more) + b"\n\ndata: [DONE]\n\n")
        return resp


def test_nothing_after_an_upstream_error_event_is_relayed(make_gateway):
    with ThreadedServer(ErrorThenMore()) as upstream:  # type: ignore[arg-type]
        gw = make_gateway([openai_route(upstream)], tenant_keys=KEYS)
        events = events_of(stream(gw, usage=False))
    assert events[-1] == "[DONE]"
    assert {"error": {"message": "overloaded", "type": "server_error"}} in events
    assert not any("smuggled" in orjson.dumps(e).decode() for e in events)


class Writer:
    """A client connection for the relay's diverted writes; `paused` until `drained`."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False
        self.drained = asyncio.Event()

    def ready(self) -> bool:
        return True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    async def drain(self) -> None:
        await self.drained.wait()
        self.paused = False


class Upstream:
    """A diverted stream: records what the relay asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def stop(self) -> None:
        self.calls.append("stop")


def chunk(text: str) -> OutEvent:
    data = orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})
    return OutEvent.unread(b"data: " + data + b"\n\n", data)


def test_a_slow_client_pauses_the_upstream_until_it_has_drained():
    async def main() -> None:
        plan = SimpleNamespace(client_wants_usage=False)
        record = RequestRecord(tenant="t", model="m", stream=True)
        relay = StreamRelay(None, plan, record)  # type: ignore[arg-type]
        writer, upstream = Writer(), Upstream()
        relay._writer, relay._diverted = writer, upstream  # type: ignore[assignment]

        assert relay._forward_now([chunk("a")]) is False
        assert upstream.calls == [] and record.content_events == 1
        writer.paused = True  # the client's socket buffer is full
        relay._forward_now([chunk("b")])
        relay._forward_now([chunk("c")])  # one read may still come in: no second pause
        assert upstream.calls == ["pause"]
        writer.drained.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert upstream.calls == ["pause", "resume"]
        assert b"".join(writer.written).count(b"data: ") == 3

        writer.paused, writer.drained = True, asyncio.Event()
        relay._forward_now([chunk("d")])
        relay._undivert()  # the relay ends while the client is still slow
        await asyncio.sleep(0)
        assert upstream.calls == ["pause", "resume", "pause", "stop"]

    asyncio.run(main())
