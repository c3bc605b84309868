"""Server-sent events: split an upstream byte stream into whole events without re-encoding them.

The gateway forwards each event's original bytes the moment its terminating blank line arrives;
it parses only the `data:` payload it needs to look at (usage, first content, errors).

The upstream is not trusted: one event is bounded (`max_event_bytes`), and a partial event is
never rescanned from its start, so a stream costs time linear in its bytes however it is cut.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass

import orjson

KEEPALIVE = b": keepalive\n\n"
DONE = b"data: [DONE]\n\n"
DONE_DATA = b"[DONE]"
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

# What every event stream the gateway answers with carries: no caching, no proxy buffering.
SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache, no-transform",
    "x-accel-buffering": "no",
    "connection": "keep-alive",
}
SSE_RAW_HEADERS = tuple((k.encode(), v.encode()) for k, v in SSE_HEADERS.items())


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # the event's bytes as received, terminator included
    data: bytes | None  # joined `data:` lines, None for comment-only events
    event: str | None = None


class EventTooLarge(ValueError):
    """An event past the limit. `events` are the whole events that came before it in the same
    chunk, so a caller can still deliver them before it reports the failure."""

    def __init__(self, limit: int, events: list[SSEEvent]) -> None:
        super().__init__(f"an upstream event exceeded {limit} bytes")
        self.limit = limit
        self.events = events


class SSEParser:
    """Incremental parser: feed chunks, get back the events they complete.

    The common case (no partial event held, `\\n` line ends) takes the same few steps as a
    plain split of the chunk. A partial event is kept as a list of its pieces, joined once when
    its end arrives, and only the new bytes are searched for that end.
    """

    __slots__ = ("_cr", "_limit", "_parts", "_size")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._parts: list[bytes] = []  # the partial event held, in pieces
        self._size = 0
        self._cr = False  # the last chunk ended in `\r`: a leading `\n` belongs to it
        self._limit = max_event_bytes

    @property
    def holding(self) -> bool:
        """Whether part of an event (or a line end split in two) waits for the next chunk."""
        return bool(self._parts) or self._cr

    @property
    def limit(self) -> int:
        return self._limit

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._cr or b"\r" in chunk:
            chunk = self._normalise(chunk)
        if self._parts:
            return self._feed_pending(chunk)
        return self._split(chunk, [])

    def _split(self, buffer: bytes, events: list[SSEEvent]) -> list[SSEEvent]:
        """Whole events from `buffer` (which starts at an event boundary); holds the tail."""
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            if end + 2 - start > self._limit:
                raise EventTooLarge(self._limit, events)
            events.append(_parse_event(buffer[start : end + 2]))
            start = end + 2
        if start < len(buffer):
            self._hold(buffer[start:] if start else buffer, events)
        return events

    def _hold(self, tail: bytes, events: list[SSEEvent]) -> None:
        if len(tail) > self._limit:
            raise EventTooLarge(self._limit, events)
        self._parts = [tail]
        self._size = len(tail)

    def _feed_pending(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        parts = self._parts
        if chunk[:1] == b"\n" and parts[-1].endswith(b"\n"):
            cut = 1  # the blank line straddles the two chunks
        else:
            end = chunk.find(b"\n\n")
            if end < 0:
                parts.append(chunk)
                self._size += len(chunk)
                if self._size > self._limit:
                    raise EventTooLarge(self._limit, [])
                return []
            cut = end + 2
        if self._size + cut > self._limit:
            raise EventTooLarge(self._limit, [])
        parts.append(chunk[:cut])
        first = _parse_event(b"".join(parts))
        self._parts = []
        self._size = 0
        return self._split(chunk[cut:], [first])

    def _normalise(self, chunk: bytes) -> bytes:
        """CRLF and CR line ends -> LF, also when a CRLF pair is split across two chunks."""
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def flush(self) -> list[SSEEvent]:
        """The unterminated tail at end of stream, if any (some servers omit the last blank
        line)."""
        tail = b"".join(self._parts)
        self._parts = []
        self._size = 0
        if tail.strip():
            return [_parse_event(tail.rstrip(b"\n") + b"\n\n")]
        return []


def _parse_event(raw: bytes) -> SSEEvent:
    if raw.startswith(b"data: ") and raw.find(b"\n", 6) == len(raw) - 2:
        return SSEEvent(raw, raw[6:-2])  # the usual event: one `data: ` line
    data_lines = []
    name = None
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data_lines.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    data = b"\n".join(data_lines) if data_lines else None
    return SSEEvent(raw, data, name)


def encode_data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event_name(event: SSEEvent) -> str | None:
    """An event's name: its `event:` line, else its payload's `type` (parsed only then)."""
    if event.event is not None:
        return event.event
    data = event.data
    if not data or b'"type"' not in data:
        return None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    kind = payload.get("type") if isinstance(payload, dict) else None
    return kind if isinstance(kind, str) else None


@dataclass(slots=True)
class EventRead:
    """The whole events one upstream read completed, and when the read came in."""

    events: list[SSEEvent]
    arrived: float
    too_big: bool = False  # the next event passed the limit: the stream cannot go on
    last: bool = False  # the body ended; `events` holds what the parser still had


async def read_events(chunks: AsyncIterable[bytes], limit: int) -> AsyncGenerator[EventRead, None]:
    """An upstream body as whole events, read by read, each within `limit` bytes: a partial
    event is never delivered. Ends after a `too_big` read, or with a `last` one. Closing it
    closes `chunks` too (a generator of its own, for a `bedrock` route), so a reader that
    stops at the answer's end and closes it leaves neither for the event loop."""
    parser = SSEParser(limit)
    try:
        async for chunk in chunks:
            arrived = time.perf_counter()
            try:
                events = parser.feed(chunk)
            except EventTooLarge as exc:  # the events that did complete still go out first
                yield EventRead(exc.events, arrived, too_big=True)
                return
            yield EventRead(events, arrived)
        yield EventRead(parser.flush(), time.perf_counter(), last=True)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
