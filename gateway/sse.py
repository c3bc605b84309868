"""Server-sent events: split an upstream byte stream into whole events without re-encoding them.

The gateway forwards each event's original bytes the moment its terminating blank line arrives;
it parses only the `data:` payload it needs to look at (usage, first content, errors).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

KEEPALIVE = b": keepalive\n\n"
DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "cache-control": "no-cache, no-transform",
    "x-accel-buffering": "no",
    "connection": "keep-alive",
}


@dataclass(slots=True)
class SSEEvent:
    raw: bytes               # the event's bytes as received, terminator included
    data: bytes | None       # joined `data:` lines, None for comment-only events
    event: str | None = None


class SSEParser:
    """Incremental parser: feed chunks, get back the events they complete."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            events.append(_parse_event(buffer[start:end + 2]))
            start = end + 2
        self._buffer = buffer[start:]
        return events

    def flush(self) -> list[SSEEvent]:
        """The unterminated tail at end of stream, if any (some servers omit the last blank line)."""
        tail, self._buffer = self._buffer, b""
        if tail.strip():
            return [_parse_event(tail.rstrip(b"\n") + b"\n\n")]
        return []


def _parse_event(raw: bytes) -> SSEEvent:
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
