"""The OpenAI event stream reads a chunk of whole one-line JSON events without the general SSE
parser; whatever the chunking, the events it yields are the parser's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sse import SSEParser
from gateway.upstreams.openai import OpenAIEventStream, json_events

EVENTS = [
    b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"b\\nc"},"finish_reason":null}]}\n\n',
    b'event: message\ndata: {"choices":[]}\n\n',
    b": keepalive\n\n",
    b'data: {"x":\r\n1}\r\n\r\n',
    b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n',
]


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _Response:
    raw_headers: tuple = ()

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)


def _through_stream(chunks: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    async def run() -> list[tuple[bytes, bytes | None]]:
        out = []
        async for batch in OpenAIEventStream(_Response(chunks)):  # type: ignore[arg-type]
            out.extend((event.raw, event.data) for event in batch)
        return out

    return asyncio.run(run())


def _through_parser(chunks: list[bytes]) -> list[tuple[bytes, bytes | None]]:
    parser = SSEParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.flush()
    return [(e.raw, e.data) for e in events]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(EVENTS), min_size=1, max_size=8),
    st.lists(st.integers(min_value=1, max_value=400), max_size=6),
)
def test_any_chunking_yields_the_parsers_events(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events)
    points = sorted({c % len(stream) for c in cuts} - {0})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert _through_stream(chunks) == _through_parser(chunks)


def test_only_whole_single_line_json_events_take_the_short_way() -> None:
    one, two = EVENTS[0], EVENTS[1]
    assert json_events(one, 1 << 20) == [one]
    assert json_events(one + two + one, 1 << 20) == [one, two, one]
    assert not any(json_events(e, 1 << 20) for e in EVENTS[2:5])
    assert json_events(one + EVENTS[3], 1 << 20) is None  # a comment after a whole event
    assert json_events(one + b"data: [DONE]\n\n", 1 << 20) is None
    assert json_events(one + b"\n" + two, 1 << 20) is None  # an empty line between events
    assert json_events(one[:-1], 1 << 20) is None
    assert json_events(one + two[:-1], 1 << 20) is None


def test_an_event_over_the_limit_is_left_to_the_parser() -> None:
    one, two = EVENTS[0], EVENTS[1]
    assert json_events(one + two, len(two)) == [one, two]
    assert json_events(one + two, len(two) - 1) is None
    assert json_events(two, len(two) - 1) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=8))
def test_whole_events_in_one_read_are_the_parsers_events(events: list[bytes]) -> None:
    chunk = b"".join(events)
    assert _through_stream([chunk]) == _through_parser([chunk])
