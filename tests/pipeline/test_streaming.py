"""Streams are never buffered, and a client that leaves closes the upstream request at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from aiohttp import web

from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route

BODY = {"model": "mock-1", "stream": True, "messages": [{"role": "user", "content": "x"}]}


def assert_upstream_saw_client_leave(mock, left: float) -> None:
    """The upstream notices the dropped connection within a second of the client leaving."""
    deadline = left + 3
    while not mock.disconnects and time.perf_counter() < deadline:
        time.sleep(0.02)
    assert mock.disconnects, "upstream never saw the client leave"
    assert mock.disconnects[0] - left < 1.0


def test_client_gets_event_one_before_upstream_sends_event_two(mock_upstream, make_gateway):
    hold = asyncio.Event()
    mock_upstream.mock.behaviour.hold_after_first = hold
    gw = make_gateway([openai_route(mock_upstream)])
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=BODY, timeout=httpx.Timeout(5.0)
    ) as r:
        lines = r.iter_lines()
        for line in lines:
            if "tok0" in line:
                break
        # The upstream is parked after event 1 until the client has it: a buffering gateway
        # would never hand it over and the read above would time out.
        assert not hold.is_set()
        mock_upstream.call(hold.set)
        rest = "\n".join(lines)
    assert "tok0" not in rest and "tok1" in rest and "[DONE]" in rest


def test_client_disconnect_closes_upstream_within_a_second(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.chunks = 50
    mock_upstream.mock.behaviour.gap_s = 0.1
    gw = make_gateway([openai_route(mock_upstream)])
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=BODY, timeout=10) as r:
        for line in r.iter_lines():
            if "tok0" in line:
                break
        left = time.perf_counter()
    assert_upstream_saw_client_leave(mock_upstream.mock, left)


def test_anthropic_route_through_openai_sdk(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    c = sdk_client(gw)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    resp = c.chat.completions.create(model="claude-x", messages=messages)
    assert resp.choices[0].message.content == "Hello from Claude"
    assert resp.usage.prompt_tokens_details.cached_tokens == 100
    sent = mock_upstream.mock.requests[-1]
    assert sent["path"] == "/v1/messages" and sent["headers"]["x-api-key"] == "sk-upstream-secret"
    assert sent["body"]["system"][0]["text"] == "be brief"

    chunks = list(
        c.chat.completions.create(
            model="claude-x", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Hello from Claude"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 100


def test_anthropic_tool_use_stream(mock_upstream, make_gateway):
    gw = make_gateway([anthropic_route(mock_upstream)])
    c = sdk_client(gw)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    args, names, finish = "", [], None
    for ch in c.chat.completions.create(
        model="claude-x",
        tools=tools,
        stream=True,
        messages=[{"role": "user", "content": "weather?"}],
    ):
        if not ch.choices:
            continue
        for call in ch.choices[0].delta.tool_calls or []:
            if call.function.name:
                names.append(call.function.name)
            args += call.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert names == ["get_weather"] and args == '{"city": "Paris"}' and finish == "tool_calls"


def test_non_streaming_client_that_leaves_closes_the_upstream(mock_upstream, make_gateway):
    mock_upstream.mock.behaviour.first_delay_s = 5.0
    gw = make_gateway([openai_route(mock_upstream)])
    body = {"model": "mock-1", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(0.5))
    left = time.perf_counter()
    assert_upstream_saw_client_leave(mock_upstream.mock, left)


def test_finished_streams_leave_their_upstream_connection_for_the_next_request(make_gateway):
    # The relay stops reading at `[DONE]`; the chunked body's terminator follows it, here a
    # little later. A stream that ended so must not cost the next request a new connection (a
    # TCP and TLS handshake to a remote provider); one the client abandons still drops its
    # connection at once (test_client_disconnect_closes_upstream_within_a_second).
    from tests.security.hostile_upstream import HostileServer, openai_stream

    peers: list[int] = []
    ended: list[float] = []

    async def late_terminator(request):
        peers.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for event in openai_stream("hello there"):
            await resp.write(event)
        await asyncio.sleep(0.05)  # `[DONE]` is out; the body's end comes after it
        await resp.write_eof()
        ended.append(time.perf_counter())
        return resp

    with HostileServer(late_terminator) as upstream:
        gw = make_gateway([openai_route(upstream)])
        for sent in range(1, 7):
            r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=30)
            assert r.status_code == 200 and "hello" in r.text
            deadline = time.perf_counter() + 10
            while len(ended) < sent and time.perf_counter() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)  # the gateway reads the terminator and parks the connection
    assert len(peers) == 6
    # One connection carries them all, but a loaded machine may send the next request before
    # the gateway has read a terminator (the warm spare takes it): never one per request.
    assert len(set(peers)) <= 3, peers


def test_a_failure_writing_the_first_events_ends_the_stream_without_a_retry(
    mock_upstream, make_gateway, monkeypatch
):
    # The first events go out inside the attempt, but once they are here the attempt has
    # succeeded: a failure to write them ends the stream like any failure mid-stream (an
    # error event, then [DONE]), and the upstream is not asked again.
    from gateway.pipeline.answer import ChatFormat

    real = ChatFormat.events
    calls: list[int] = []

    def first_write_fails(self, batch, keep_usage):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("the first write breaks")
        return real(self, batch, keep_usage)

    monkeypatch.setattr(ChatFormat, "events", first_write_fails)
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=3)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30)
    assert r.status_code == 200
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events
    assert len(calls) == 1  # nothing was read or written after the failure
    assert [q["path"] for q in mock_upstream.mock.requests] == ["/v1/chat/completions"]
