"""Upstream answers are untrusted: redirects, huge events and bodies, bad usage, HTML 200s,
broken streams, hangs. Each class of answer has a test against a hostile loopback upstream
(`hostile_upstream.py`); the client always gets a clean status or a stream that ends with a
finish or an error event, then `[DONE]`, and nothing after it."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.config.routes import Route
from gateway.sse import EventTooLarge, SSEParser
from gateway.translation.anthropic import TranslationError, to_anthropic_request
from gateway.upstreams.base import CallContext, UpstreamError
from gateway.upstreams.openai import OpenAIUpstream
from tests.security.conftest import UPSTREAM_KEY
from tests.security.hostile_upstream import (
    DONE,
    HostileServer,
    anthropic_event,
    anthropic_stream,
    chunk,
    completion,
    endless_answer,
    json_answer,
    openai_stream,
    redirect_answer,
    sse_answer,
)
from tests.support.clients import sdk_client
from tests.support.gateway import anthropic_route, openai_route
from tests.support.waiting import eventually

CHAT = {"model": "gpt-x", "messages": [{"role": "user", "content": "secret prompt"}]}
STREAM = {**CHAT, "stream": True}
CLAUDE = {**CHAT, "model": "claude-x"}


def openai_to(server: HostileServer, **extra) -> dict:
    return openai_route(server, name="hostile", models=["gpt-*"], **extra)


def post(gw, body: dict, path: str = "/v1/chat/completions", timeout: float = 20) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=timeout)


def stream_payloads(
    gw, body: dict = STREAM, timeout: float = 20
) -> tuple[httpx.Response, list[str]]:
    """The `data:` payloads of a streamed answer, in order (comments left out)."""
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        text = r.read().decode()
    payloads = []
    for event in text.split("\n\n"):
        data = [line[5:].lstrip(" ") for line in event.split("\n") if line.startswith("data:")]
        if data:
            payloads.append("\n".join(data))
    return r, payloads


def assert_clean_end(payloads: list[str], *, error: bool) -> None:
    """Exactly one [DONE], last; before it an error event (error=True) or a finish chunk."""
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1
    last = orjson.loads(payloads[-2])
    if error:
        assert set(last) == {"error"} and last["error"]["message"]
    else:
        assert "error" not in last
        assert any(
            orjson.loads(p).get("choices") and orjson.loads(p)["choices"][0].get("finish_reason")
            for p in payloads[:-1]
        )


def text_of(payloads: list[str]) -> str:
    out = ""
    for p in payloads:
        if p == "[DONE]":
            continue
        body = orjson.loads(p)
        for choice in body.get("choices") or ():
            out += (choice.get("delta") or {}).get("content") or ""
    return out


def metric(gw, name: str, **labels: str) -> float:
    """Sum of a Prometheus series from the gateway's /metrics over the given label values."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- redirects are never followed -------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", STREAM),
        ("/v1/completions", {"model": "gpt-x", "prompt": "secret prompt"}),
    ],
)
def test_redirect_is_an_upstream_error_and_the_prompt_stays_home(
    hostile, witness, make_gateway, path, body
):
    hostile.upstream.handler = redirect_answer(witness.origin + "/v1/chat/completions")
    gw = make_gateway([openai_to(hostile)])
    r = post(gw, body, path)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_307"
    assert witness.upstream.requests == []
    assert len(hostile.upstream.posts()) == 1  # a redirect is not retried either


def test_redirect_on_anthropic_route_never_carries_the_key_away(hostile, witness, make_gateway):
    hostile.upstream.handler = redirect_answer(witness.origin + "/v1/messages", status=308)
    gw = make_gateway([anthropic_route(hostile)])
    for body in (CLAUDE, {**CLAUDE, "stream": True}):
        r = post(gw, body)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_308"
    assert witness.upstream.requests == []
    assert hostile.upstream.posts()[0]["headers"]["x-api-key"] == UPSTREAM_KEY


def test_warm_up_and_model_list_do_not_follow_redirects(hostile, witness, make_gateway):
    hostile.upstream.models_handler = redirect_answer(witness.origin + "/v1/models", status=302)
    gw = make_gateway([openai_to(hostile)])
    gw.wait_ready()
    r = httpx.get(gw.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    assert "gpt-hostile" not in r.text
    assert any(q["path"] == "/v1/models" for q in hostile.upstream.requests)
    assert witness.upstream.requests == []


def test_a_hostile_model_list_is_bounded_and_filtered(hostile, make_gateway):
    from gateway.upstreams.http import MODELS_MAX_ENTRIES

    junk = [{"id": 5}, {"id": ""}, {"id": "gpt-" + "x" * 5000}, "gpt-bare", {"no": "id"}]
    many = [{"id": f"gpt-{i}", "object": "model"} for i in range(MODELS_MAX_ENTRIES + 500)]
    hostile.upstream.models_handler = json_answer({"data": [*junk, *many]})
    gw = make_gateway([openai_to(hostile)])
    gw.wait_ready()
    ids = [m.id for m in sdk_client(gw).models.list().data]
    assert ids == [f"gpt-{i}" for i in range(MODELS_MAX_ENTRIES)]  # junk skipped, then cut


def test_a_model_list_past_its_byte_limit_lists_nothing_and_serves_on(hostile, make_gateway):
    from gateway.upstreams.http import MODELS_MAX_BYTES

    pad = "p" * 1000
    count = MODELS_MAX_BYTES // 1000 + 10
    hostile.upstream.models_handler = json_answer(
        {"data": [{"id": f"gpt-{i}", "pad": pad} for i in range(count)]}
    )
    gw = make_gateway([openai_to(hostile)])
    gw.wait_ready()
    client = sdk_client(gw)
    assert client.models.list().data == []
    stream = client.chat.completions.create(model="gpt-x", messages=CHAT["messages"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "hello"


def test_model_lookups_with_hostile_ids_are_404s_served_by_the_gateway(hostile, make_gateway):
    gw = make_gateway([openai_to(hostile)])
    gw.wait_ready()
    before = len(hostile.upstream.requests)
    for model_id in ("x" * 6000, "a/../../admin", "gpt-%2e%2e", "%00", "é" * 100):
        r = httpx.get(gw.url + "/v1/models/" + model_id, timeout=10)
        assert r.status_code in (400, 404), (model_id[:20], r.status_code)
        assert len(r.content) < 2000  # the id is echoed cut short, never whole
        assert r.headers["x-request-id"]
    assert [q for q in hostile.upstream.requests[before:] if q["path"] != "/v1/models"] == []


# --- SSE events are bounded, and split in linear time ----------------------------------------


def test_sse_parser_is_linear_and_bounded():
    piece = b"x" * 65536
    parser = SSEParser(max_event_bytes=1 << 40)
    started = time.thread_time()  # this thread's CPU: another process's load does not count
    parser.feed(b"data: " + piece)
    for _ in range(32 * 16):  # 32 MiB, never terminated: the old splitter took ~20 s here
        assert parser.feed(piece) == []
    assert time.thread_time() - started < 2.0

    parser = SSEParser(max_event_bytes=100_000)
    with pytest.raises(EventTooLarge) as err:
        for _ in range(10):
            parser.feed(piece)
    assert err.value.events == []
    with pytest.raises(EventTooLarge) as err:  # whole events before the big one survive
        SSEParser(max_event_bytes=4096).feed(b"data: a\n\n" + b"data: " + b"y" * 5000)
    assert [e.data for e in err.value.events] == [b"a"]


def test_sse_parser_joins_crlf_split_across_reads():
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    events = parser.feed(b"\ndata: b\r\n\r\n")
    assert [e.data for e in events] == [b"a\nb"]
    assert [e.data for e in parser.feed(b"data: c\n") + parser.feed(b"\n")] == [b"c"]


def test_oversized_first_event_is_a_clean_502(hostile, make_gateway):
    hostile.upstream.handler = endless_answer(b"data: ", b"x" * 65536, 32 * 1024 * 1024)
    gw = make_gateway([openai_to(hostile, first_token_timeout_s=10)], max_event_bytes=256 * 1024)
    r = post(gw, STREAM)
    assert r.status_code == 502
    assert "over 262144 bytes" in r.json()["error"]["message"]
    assert len(hostile.upstream.posts()) == 1
    assert eventually(lambda: hostile.upstream.disconnects)


def test_oversized_event_mid_stream_ends_with_error_then_done(hostile, make_gateway):
    start = b"".join([chunk(""), chunk("hello")]) + b"data: "
    hostile.upstream.handler = endless_answer(start, b"x" * 65536, 32 * 1024 * 1024)
    gw = make_gateway([openai_to(hostile)], max_event_bytes=256 * 1024)
    healthz: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(gw.url + "/healthz", timeout=10)
            healthz.append(time.perf_counter() - t)
            time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        started = time.perf_counter()
        r, payloads = stream_payloads(gw)
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        poller.join(10)
    assert r.status_code == 200 and text_of(payloads) == "hello"
    assert_clean_end(payloads, error=True)
    assert elapsed < 5.0 and max(healthz) < 1.0
    assert eventually(lambda: hostile.upstream.disconnects)  # the rest is never read


# --- non-stream bodies are bounded ------------------------------------------------------------


@pytest.mark.parametrize("declared", [False, True])
def test_oversized_body_is_a_502_and_the_connection_is_dropped(hostile, make_gateway, declared):
    total = 48 * 1024 * 1024
    hostile.upstream.handler = endless_answer(
        b'{"junk": "',
        b"x" * 65536,
        total,
        content_type="application/json",
        length=total if declared else None,
    )
    gw = make_gateway([openai_to(hostile)], max_response_bytes=1024 * 1024)
    r = post(gw, CHAT)
    assert r.status_code == 502
    assert len(hostile.upstream.posts()) == 1  # not retried: it would cost the same again
    assert eventually(lambda: hostile.upstream.disconnects)


# --- malformed usage is ignored field by field ------------------------------------------------


BAD_USAGE = [
    {"prompt_tokens": 7, "completion_tokens": "abc"},
    {"prompt_tokens": 7, "completion_tokens": -5},
    {"prompt_tokens": 7, "completion_tokens": 2.5, "total_tokens": "x"},
    {
        "prompt_tokens": 7,
        "completion_tokens": {"deep": [1, {"x": None}]},
        "prompt_tokens_details": "nope",
    },
    {"prompt_tokens": 7, "completion_tokens": 2**62, "prompt_tokens_details": [1]},
    {
        "prompt_tokens": 7,
        "completion_tokens": True,
        "prompt_tokens_details": {"cached_tokens": "lots"},
    },
]


@pytest.mark.parametrize("usage", BAD_USAGE)
def test_malformed_usage_never_fails_the_request(hostile, make_gateway, usage):
    gw = make_gateway([openai_to(hostile)])
    hostile.upstream.handler = json_answer(completion("hi", usage))
    r = post(gw, CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
    hostile.upstream.handler = sse_answer(openai_stream("hi there", usage=usage))
    r, payloads = stream_payloads(gw)
    assert r.status_code == 200 and text_of(payloads) == "hi there"
    assert_clean_end(payloads, error=False)
    # Both events were recorded as ok, and the one good field of each counted.
    assert eventually(lambda: metric(gw, "firsttoken_requests_total", status="ok") == 2)
    assert metric(gw, "firsttoken_prompt_tokens_total") == 14
    assert metric(gw, "firsttoken_output_tokens_total") == 0


def test_malformed_anthropic_usage_is_ignored_field_by_field(hostile, make_gateway):
    hostile.upstream.handler = json_answer(
        {
            "id": "msg_h",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 4, "output_tokens": "abc", "cache_read_input_tokens": [1]},
        }
    )
    gw = make_gateway([anthropic_route(hostile)])
    r = post(gw, CLAUDE)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == 4 and r.json()["usage"]["completion_tokens"] == 0


# --- a 200 in the wrong shape is a 502 --------------------------------------------------------


HTML = b"<html><body>Welcome to the hotel wifi</body></html>"


@pytest.mark.parametrize(
    "body,answer",
    [
        (CHAT, json_answer(HTML, content_type="text/html")),
        (STREAM, json_answer(HTML, content_type="text/html")),
        (CHAT, json_answer(b"[1, 2]")),
        (CHAT, json_answer(b"not json at all")),
        (STREAM, json_answer(completion())),  # a server that ignored "stream"
    ],
)
def test_wrong_shape_200_is_a_retried_502_recorded_as_an_error(hostile, make_gateway, body, answer):
    hostile.upstream.handler = answer
    gw = make_gateway([openai_to(hostile)], retry_attempts=2)
    r = post(gw, body)
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    assert "hotel" not in r.text
    assert len(hostile.upstream.posts()) == 2  # like a 5xx: retried before the first byte
    assert eventually(lambda: metric(gw, "firsttoken_requests_total", status="upstream_error") == 1)
    assert metric(gw, "firsttoken_requests_total", status="ok") == 0


def test_html_200_on_anthropic_route_is_a_502(hostile, make_gateway):
    hostile.upstream.handler = json_answer(HTML, content_type="text/html")
    gw = make_gateway([anthropic_route(hostile)], retry_attempts=1)
    assert post(gw, CLAUDE).status_code == 502
    assert post(gw, {**CLAUDE, "stream": True}).status_code == 502


# --- every stream ends with a finish or an error, then [DONE], and nothing after ---------------


def test_stream_without_done_gets_one(hostile, make_gateway):
    hostile.upstream.handler = sse_answer(openai_stream("all here", done=False))
    gw = make_gateway([openai_to(hostile)])
    _r, payloads = stream_payloads(gw)
    assert text_of(payloads) == "all here"
    assert_clean_end(payloads, error=False)


@pytest.mark.parametrize("then", ["close", "reset"])
def test_stream_cut_mid_answer_ends_with_error_then_done(hostile, make_gateway, then):
    hostile.upstream.handler = sse_answer([chunk(""), chunk("half")], then=then)
    gw = make_gateway([openai_to(hostile)])
    _r, payloads = stream_payloads(gw)
    assert text_of(payloads) == "half"
    assert_clean_end(payloads, error=True)
    assert eventually(lambda: metric(gw, "firsttoken_requests_total", status="upstream_error") == 1)


def test_stream_timeout_mid_answer_ends_with_error_then_done(hostile, make_gateway):
    hostile.upstream.handler = sse_answer([chunk(""), chunk("slow")], then="hang")
    gw = make_gateway([openai_to(hostile, timeout_s=0.8)])
    _r, payloads = stream_payloads(gw)
    assert text_of(payloads) == "slow"
    assert_clean_end(payloads, error=True)
    assert orjson.loads(payloads[-2])["error"]["type"] == "timeout_error"


def test_nothing_after_done_is_read_or_forwarded(hostile, make_gateway):
    events = [*openai_stream("the end"), chunk("smuggled"), b"data: <script>\n\n"]
    hostile.upstream.handler = sse_answer(events, then="hang")
    gw = make_gateway([openai_to(hostile)])
    started = time.perf_counter()
    _r, payloads = stream_payloads(gw)
    assert time.perf_counter() - started < 5  # did not wait for the upstream to hang up
    assert text_of(payloads) == "the end" and "smuggled" not in str(payloads)
    assert_clean_end(payloads, error=False)
    assert eventually(lambda: hostile.upstream.disconnects)


@pytest.mark.parametrize(
    "bad", [b"data: <html>oops</html>\n\n", b"data: {not json}\n\n", b"data: [1, 2]\n\n"]
)
def test_malformed_event_becomes_error_then_done(hostile, make_gateway, bad):
    # Apart in time: a brace-shaped bad event is only found after it went out (events are
    # written before they are parsed), so what shares its read has gone out with it.
    events = [chunk(""), chunk("before"), bad, chunk("after"), chunk(finish="stop"), DONE]
    hostile.upstream.handler = sse_answer(events, then="hang", gap_s=0.05)
    gw = make_gateway([openai_to(hostile)])
    _r, payloads = stream_payloads(gw)
    assert "after" not in str(payloads) and "<html>" not in str(payloads)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    assert set(orjson.loads(payloads[-2])) == {"error"}
    assert eventually(lambda: hostile.upstream.disconnects)
    # The OpenAI SDK sees the text, then an error it can catch: never a hang.
    client = sdk_client(gw)
    seen = ""
    with pytest.raises((openai.APIError, ValueError)):
        for part in client.chat.completions.create(**STREAM):
            seen += part.choices[0].delta.content or "" if part.choices else ""
    assert seen == "before"


def test_anthropic_stream_closed_before_message_stop_ends_with_error_then_done(
    hostile, make_gateway
):
    hostile.upstream.handler = sse_answer(anthropic_stream("cut short", stop=False))
    gw = make_gateway([anthropic_route(hostile)])
    _r, payloads = stream_payloads(gw, {**CLAUDE, "stream": True})
    assert text_of(payloads) == "cut short"
    assert_clean_end(payloads, error=True)


def test_anthropic_events_after_message_stop_are_not_read(hostile, make_gateway):
    events = [
        *anthropic_stream("done now"),
        anthropic_event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "smuggled"}}
        ),
    ]
    hostile.upstream.handler = sse_answer(events, then="hang")
    gw = make_gateway([anthropic_route(hostile)])
    _r, payloads = stream_payloads(gw, {**CLAUDE, "stream": True})
    assert text_of(payloads) == "done now"
    assert_clean_end(payloads, error=False)
    assert eventually(lambda: hostile.upstream.disconnects)


@pytest.mark.parametrize(
    "bad",
    [
        b"data: nope\n\n",
        b'event: message_start\ndata: {"type": "message_start", "message": {"usage": [1]}}\n\n',
        b'data: {"type": "content_block_start", "index": [1], '
        b'"content_block": {"type": "tool_use"}}\n\n',
    ],
)
def test_malformed_anthropic_event_ends_with_error_then_done(hostile, make_gateway, bad):
    events = anthropic_stream("x y")
    hostile.upstream.handler = sse_answer([*events[:3], bad, *events[3:]])
    gw = make_gateway([anthropic_route(hostile)])
    r, payloads = stream_payloads(gw, {**CLAUDE, "stream": True})
    assert r.status_code == 200
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    if b"usage" in bad:  # an odd usage shape is ignored, not fatal
        assert_clean_end(payloads, error=False)
    else:
        assert_clean_end(payloads, error=True)


# --- Retry-After and rate-limit headers reach the client --------------------------------------


RATE = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-tokens": "6m0s"}


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_and_rate_limits_pass_through_on_429_and_503(hostile, make_gateway, status):
    hostile.upstream.handler = json_answer(
        {
            "error": {
                "message": "slow down",
                "type": "rate_limit_error",
                "param": None,
                "code": None,
            }
        },
        status=status,
        headers={"retry-after": "30", **RATE},
    )
    gw = make_gateway([openai_to(hostile)], retry_attempts=1)
    for body in (CHAT, STREAM):
        r = post(gw, body)
        assert r.status_code == status
        assert r.headers["retry-after"] == "30"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-tokens"] == "6m0s"


def test_rate_limit_headers_on_success(hostile, make_gateway):
    gw = make_gateway([openai_to(hostile)])
    hostile.upstream.handler = json_answer(completion(), headers=RATE)
    r = post(gw, CHAT)
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "0"
    hostile.upstream.handler = sse_answer(openai_stream("ok"), headers=RATE)
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=STREAM, timeout=20) as r:
        r.read()
    assert r.status_code == 200 and r.headers["x-ratelimit-reset-tokens"] == "6m0s"


def test_anthropic_rate_limit_headers_on_success(hostile, make_gateway):
    rate = {"anthropic-ratelimit-requests-remaining": "41"}
    hostile.upstream.handler = sse_answer(anthropic_stream("hi"), headers=rate)
    gw = make_gateway([anthropic_route(hostile)])
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json={**CLAUDE, "stream": True}, timeout=20
    ) as r:
        r.read()
    assert r.headers["anthropic-ratelimit-requests-remaining"] == "41"


# --- a first-token deadline longer than the keepalive interval is still a clean 504 -----------


def test_first_token_deadline_past_keepalive_is_a_clean_504(hostile, make_gateway):
    hostile.upstream.handler = sse_answer([], then="hang")  # a 200, then never an event
    gw = make_gateway(
        [openai_to(hostile)], keepalive_s=0.2, first_token_timeout_s=1, retry_attempts=1
    )
    started = time.perf_counter()
    r = post(gw, STREAM)
    assert r.status_code == 504
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "timeout_error" and "keepalive" not in r.text
    assert 0.9 < time.perf_counter() - started < 5


# --- malformed input is the client's 400, never a 502 -----------------------------------------


def test_anthropic_tool_choice_of_wrong_shape_is_a_400_naming_the_param(hostile, make_gateway):
    gw = make_gateway([anthropic_route(hostile)])
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = post(gw, {**CLAUDE, "tools": tools, "tool_choice": {"type": "function", "function": "f"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice.function.name"
    assert hostile.upstream.posts() == []


def test_completions_on_an_anthropic_route_is_a_400(hostile, make_gateway):
    gw = make_gateway([anthropic_route(hostile)])
    r = post(gw, {"model": "claude-x", "prompt": "hi"}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert hostile.upstream.posts() == []


def test_body_orjson_cannot_encode_is_a_400_never_sent_nor_retried(hostile):
    deep: object = "x"
    for _ in range(300):
        deep = [deep]
    upstream = OpenAIUpstream(
        Route(name="h", models=("*",), kind="openai", base_url=hostile.base_url), api_key="k"
    )
    ctx = CallContext("chat", "t", "m", "r1")

    async def call() -> UpstreamError:
        await upstream.start()
        try:
            with pytest.raises(UpstreamError) as err:
                await upstream.complete({**CHAT, "metadata": deep}, ctx)
            return err.value
        finally:
            await upstream.aclose()

    error = asyncio.run(call())
    assert error.status == 400 and not error.retryable
    assert orjson.loads(error.body)["error"]["type"] == "invalid_request_error"
    assert hostile.upstream.posts() == []


def test_too_deep_body_through_the_gateway_is_a_400(hostile, make_gateway):
    gw = make_gateway([openai_to(hostile)])
    deep = "[" * 300 + "]" * 300
    raw = (
        b'{"model": "gpt-x", "messages": [{"role": "user", "content": "x"}], "x": '
        + deep.encode()
        + b"}"
    )
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=20,
    )
    assert r.status_code == 400
    assert hostile.upstream.posts() == []


# --- the Anthropic translator: only TranslationError, whatever the shapes --------------------


BASE = {
    "model": "x",
    "messages": [
        {
            "role": "system",
            "content": [{"type": "text", "text": "s", "cache_control": {"type": "e"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                {"type": "file", "file": {"file_data": "data:application/pdf;base64,AA"}},
            ],
            "cache_control": {"type": "e"},
        },
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]},
        {"role": "user", "content": "q"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "parallel_tool_calls": False,
    "stop": ["x"],
    "temperature": 0.5,
    "top_p": 0.9,
    "max_tokens": 10,
    "n": 1,
    "response_format": {"type": "text"},
    "user": "u",
    "stream": True,
}


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for key, value in obj.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            out += _paths(value, (*prefix, i))
    return out


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2),
    st.floats(),
    st.text(max_size=3),
    st.sampled_from(
        ["text", "function", "auto", "none", "required", "data:", "http://x", "{}", "[1]"]
    ),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2),
        st.dictionaries(
            st.sampled_from(["type", "name", "text", "function", "url", "id"]), inner, max_size=2
        ),
    ),
    max_leaves=5,
)


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(_paths(BASE)), _VALUES), min_size=1, max_size=2))
@example([(("tool_choice", "function"), "f")])
def test_translator_rejects_any_wrong_type_with_a_named_param(mutations):
    body = copy.deepcopy(BASE)
    for path, value in mutations:
        target = body
        try:
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass
    try:
        orjson.dumps(to_anthropic_request(body, "m"))
    except TranslationError as exc:
        assert exc.param is None or re.match(r"^[a-z_]+", exc.param)
