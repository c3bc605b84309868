"""AWS's binary event-stream framing (`application/vnd.amazon.eventstream`), decoded by
botocore's own parser as the bytes arrive.

Each message has a prelude (lengths, CRC), typed headers and a payload. The Bedrock runtime
sends `:message-type: event` messages (`:event-type` `chunk` for InvokeModel, `messageStart`,
`contentBlockDelta`, ... for Converse), `exception` messages (`:exception-type`, e.g.
`throttlingException`, a JSON `{"message"}` payload) and `error` messages (`:error-code`,
`:error-message`). Messages are handed on the moment each completes; what is held back is at
most one incomplete message, within `limit` bytes. botocore is imported by the first decoder.
"""

from __future__ import annotations

from dataclasses import dataclass


class EventStreamBroken(Exception):
    """The bytes are not a valid event stream (a bad CRC, a bad prelude) or a message is
    past the limit: nothing after it can be read."""


@dataclass(slots=True)
class AwsMessage:
    kind: str  # "event" | "exception" | "error"
    name: str  # the event type, exception type or error code
    payload: bytes


class EventStreamDecoder:
    """Feed network reads, get whole messages; `limit` bounds the bytes of one message."""

    def __init__(self, limit: int) -> None:
        # botocore is imported with the first bedrock stream, never by a gateway without one.
        from botocore.eventstream import EventStreamBuffer, ParserError

        self._buffer = EventStreamBuffer()
        self._parser_error: type[Exception] = ParserError
        self._limit = limit
        self._pending = 0  # bytes fed and not yet part of a message handed on

    def feed(self, data: bytes) -> list[AwsMessage]:
        self._pending += len(data)
        self._buffer.add_data(data)
        out = []
        try:
            for message in self._buffer:
                self._pending -= message.prelude.total_length
                out.append(_message(message.headers, message.payload))
        except self._parser_error as exc:
            raise EventStreamBroken(f"malformed event stream ({type(exc).__name__})") from None
        if self._pending > self._limit:
            raise EventStreamBroken(f"an event-stream message exceeded {self._limit} bytes")
        return out

    @property
    def holding(self) -> bool:
        """Bytes of an unfinished message are held: the stream was cut if it ends now."""
        return self._pending > 0


def _message(headers: dict, payload: bytes) -> AwsMessage:
    kind = str(headers.get(":message-type") or "event")
    if kind == "exception":
        return AwsMessage(kind, str(headers.get(":exception-type") or ""), payload)
    if kind == "error":
        code = str(headers.get(":error-code") or "")
        text = str(headers.get(":error-message") or "")
        return AwsMessage(kind, code, payload or text.encode())
    return AwsMessage(kind, str(headers.get(":event-type") or ""), payload)
