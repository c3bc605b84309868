"""The Gemini event stream: Google's CRLF-framed `data:` events however the network cuts them,
and every way an untrusted stream can go wrong ends in one error event (or a 502 before the
first byte for an event past the limit)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.translation.gemini import GeminiStreamTranslator
from gateway.upstreams.base import UpstreamError
from gateway.upstreams.gemini import GeminiEventStream


def event(text: str, finish: str | None = None) -> bytes:
    candidate: dict = {"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    chunk = {"candidates": [candidate], "usageMetadata": {"promptTokenCount": 7}}
    return b"data: " + orjson.dumps(chunk) + b"\r\n\r\n"


STREAM = event("Hel") + event("lo") + event("", "STOP")


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _Response:
    raw_headers: tuple = ()
    closed = True

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)


def read(chunks: list[bytes], limit: int = 1 << 20) -> list:
    async def run() -> list:
        translator = GeminiStreamTranslator("gemini-x", request_id="chatcmpl-1", created=1)
        stream = GeminiEventStream(_Response(chunks), translator, limit, "g")  # type: ignore[arg-type]
        return [e for batch in [b async for b in stream] for e in batch]

    return asyncio.run(run())


def texts(events: list) -> str:
    return "".join(
        (e.chunk["choices"][0]["delta"].get("content") or "")
        for e in events
        if e.chunk and e.chunk.get("choices")
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), unique=True, max_size=8))
def test_any_cut_gives_the_same_answer(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    events = read([STREAM[a:b] for a, b in itertools.pairwise(bounds)])
    assert texts(events) == "Hello"
    assert events[-1].done and events[-2].usage_only
    assert not any(e.error for e in events)


@pytest.mark.parametrize(
    "tail",
    [
        b"data: [1, 2]\r\n\r\n",  # not an object
        b"data: {not json\r\n\r\n",
        b'data: {"error": {"code": 500, "message": "boom", "status": "INTERNAL"}}\r\n\r\n',
        b"",  # the connection ends before a finish reason
    ],
)
def test_a_broken_stream_ends_in_one_error_event(tail):
    events = read([event("Hi") + tail])
    assert events[-1].error and not any(e.done for e in events)
    assert sum(e.error for e in events) == 1


def test_an_event_past_the_limit_is_an_upstream_error():
    with pytest.raises(UpstreamError, match="over 64 bytes"):
        read([event("x" * 200)], limit=64)
