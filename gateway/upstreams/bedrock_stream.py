"""A Bedrock event stream read as it arrives: as OpenAI chunks for the chat path, or as
Anthropic's own SSE for the Messages door.

The body is AWS event-stream framing (`aws_eventstream`). InvokeModel sends `chunk` events whose
`bytes` are the base64 of one Anthropic stream event each; Converse sends its own events by
name. Either way an `exception` message (throttling, validation, a model stream error) ends the
answer: before any content it is raised as the `UpstreamError` it maps to, so the proxy may
retry and the client gets its status (a throttle is a 429); after content it is an in-stream
error event. `open` reads up to the first content for that reason (a failure in the read that
brought it still counts as before: nothing went out), so the status line waits for the first
token, never for the whole answer.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
import orjson

from gateway.errors import error_body
from gateway.sse import DONE, encode_data
from gateway.translation.anthropic import AnthropicStreamError, AnthropicStreamTranslator
from gateway.translation.converse_to_chat import ConverseStreamTranslator
from gateway.upstreams.aws_eventstream import AwsMessage, EventStreamBroken, EventStreamDecoder
from gateway.upstreams.base import OutEvent, UpstreamError
from gateway.upstreams.bedrock_wire import bedrock_error

# Anthropic's error types for a Bedrock exception's status, for the Messages door.
_ANTHROPIC_TYPES = {
    429: "rate_limit_error",
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    503: "overloaded_error",
}
_STATUS_BY_ANTHROPIC_TYPE = {"rate_limit_error": 429, "overloaded_error": 503}


class Malformed(Exception):
    """An event the upstream should not have sent (not JSON, bad base64)."""


def anthropic_event(message: AwsMessage) -> dict | None:
    """The Anthropic stream event inside an InvokeModel `chunk` (None for other events)."""
    if message.name != "chunk":
        return None
    try:
        outer = orjson.loads(message.payload)
        event = orjson.loads(base64.b64decode(outer["bytes"], validate=True))
    except (orjson.JSONDecodeError, binascii.Error, KeyError, TypeError, ValueError):
        raise Malformed("the upstream sent a malformed chunk event") from None
    if not isinstance(event, dict):
        raise Malformed("the upstream sent a chunk that is not a JSON object")
    return event


class ChunkSource(Protocol):
    """One API's events -> chat chunks; `ended` once its last event came, `whole` once the
    answer finished (an end of the body after that is no failure)."""

    ended: bool

    @property
    def whole(self) -> bool: ...

    def feed(self, message: AwsMessage) -> list[dict]: ...


class AnthropicChunks:
    """InvokeModel on a Claude model: the existing Anthropic translation, fed the events."""

    def __init__(self, translator: AnthropicStreamTranslator) -> None:
        self.translator = translator
        self.ended = self.whole = False

    def feed(self, message: AwsMessage) -> list[dict]:
        event = anthropic_event(message)
        if event is None:
            return []
        kind = event.get("type")
        chunks = self.translator.feed(kind if isinstance(kind, str) else "", event)
        if kind == "message_stop":
            self.ended = self.whole = True
        return chunks


class ConverseChunks:
    def __init__(self, translator: ConverseStreamTranslator) -> None:
        self.translator = translator
        self.ended = False

    @property
    def whole(self) -> bool:
        return self.translator.stopped

    def feed(self, message: AwsMessage) -> list[dict]:
        try:
            data = orjson.loads(message.payload) if message.payload else {}
        except orjson.JSONDecodeError:
            raise Malformed(f"the upstream sent a malformed {message.name[:40]!r} event") from None
        if not isinstance(data, dict):
            raise Malformed(f"the upstream sent a {message.name[:40]!r} event that is no object")
        chunks = self.translator.feed(message.name, data)
        if message.name == "metadata":
            self.ended = True
        return chunks


class MessageReader:
    """Whole event-stream messages from an aiohttp body, one list per network read."""

    def __init__(self, resp: aiohttp.ClientResponse, limit: int) -> None:
        self.resp = resp
        self.decoder = EventStreamDecoder(limit)
        self.at_end = False

    async def next(self) -> list[AwsMessage]:
        """The messages completed by the next read; [] with `at_end` once the body ended."""
        while True:
            data = await self.resp.content.readany()
            if not data:
                self.at_end = True
                return []
            messages = self.decoder.feed(data)  # EventStreamBroken: the caller decides
            if messages:
                return messages

    def close(self) -> None:
        if not self.resp.closed:
            self.resp.close()


def stream_exception(route: str, message: AwsMessage) -> UpstreamError:
    """An in-stream `exception` or `error` message as the error it maps to."""
    return bedrock_error(route, 500, message.name, message.payload)


class BedrockEventStream:
    """Bedrock's stream as `OutEvent` batches for the proxy (the `EventStream` contract)."""

    def __init__(
        self, reader: MessageReader, source: ChunkSource, route: str, relayed: list | None
    ) -> None:
        self._reader = reader
        self._source = source
        self._route = route
        self._first: list[OutEvent] = []
        self._done = False
        self.relayed = relayed

    async def open(self) -> None:
        """Read up to the first content; a failure before it is raised, not sent."""
        while not self._done:
            batch = await self._read(before_content=True)
            self._first.extend(batch)
            if any(event.content for event in batch) or self._reader.at_end:
                return

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        if self._first:
            first, self._first = self._first, []
            yield first
        while not self._done:
            batch = await self._read(before_content=False)
            if batch:
                yield batch

    async def _read(self, before_content: bool) -> list[OutEvent]:
        try:
            messages = await self._reader.next()
        except EventStreamBroken as exc:
            return self._fail(UpstreamError(f"route {self._route!r}: {exc}"), before_content)
        if self._reader.at_end:
            self._done = True
            if self._source.whole:
                return [OutEvent(DONE, done=True)]
            cut = UpstreamError(f"route {self._route!r}: the stream ended before the answer did")
            return self._fail(cut, before_content)
        out: list[OutEvent] = []
        for message in messages:
            if message.kind != "event":
                return out + self._fail(stream_exception(self._route, message), before_content)
            try:
                chunks = self._source.feed(message)
            except AnthropicStreamError as exc:
                status = _STATUS_BY_ANTHROPIC_TYPE.get(exc.type, 502)
                error = UpstreamError(
                    f"route {self._route!r}: {exc.message}", status=status, retryable=True
                )
                if status == 429:
                    error.body = orjson.dumps(exc.to_openai())
                return out + self._fail(error, before_content)
            except (Malformed, AttributeError, TypeError, ValueError, KeyError) as exc:
                text = str(exc) if isinstance(exc, Malformed) else "a malformed event"
                error = UpstreamError(f"route {self._route!r}: {text}", retryable=False)
                return out + self._fail(error, before_content)
            out.extend(OutEvent.of_chunk(chunk) for chunk in chunks)
            if self._source.ended:
                self._done = True
                out.append(OutEvent(DONE, done=True))
                return out
        return out

    def _fail(self, error: UpstreamError, before_content: bool) -> list[OutEvent]:
        self._done = True
        if before_content:  # nothing went out yet: the proxy may retry, the client gets a status
            raise error
        payload = orjson.loads(error.body) if error.body else error_body(error.message)
        return [OutEvent(encode_data(payload), error=True, chunk=payload)]

    async def aclose(self) -> None:
        self._reader.close()


class MessagesSSE:
    """Bedrock's InvokeModel stream re-framed as the Anthropic SSE the Messages API sends:
    each `chunk`'s event goes out as `event: <type>` with its decoded JSON, byte for byte."""

    def __init__(self, reader: MessageReader, route: str) -> None:
        self._reader = reader
        self._route = route
        # Bedrock's request id under the name the relay passes on (`x-request-id`)
        self.raw_headers = tuple(
            (b"x-request-id", value)
            for name, value in reader.resp.raw_headers
            if name.lower() == b"x-amzn-requestid"
        )[:1]
        self._first: list[bytes] = []
        self._done = False
        self._content = False

    async def open(self) -> None:
        """Read up to the first content delta: a throttle before it is raised as a 429."""
        while not self._done:
            frames = await self._frames(before_content=True)
            self._first.extend(frames)
            if self._content or self._reader.at_end:
                return

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._first:
            first, self._first = b"".join(self._first), []
            yield first
        while not self._done:
            frames = await self._frames(before_content=False)
            if frames:
                yield b"".join(frames)

    async def _frames(self, before_content: bool) -> list[bytes]:
        try:
            messages = await self._reader.next()
        except EventStreamBroken as exc:
            return self._fail(UpstreamError(f"route {self._route!r}: {exc}"), before_content)
        if self._reader.at_end:
            self._done = True  # the relay reports a stream cut before message_stop
            return []
        out: list[bytes] = []
        for message in messages:
            if message.kind != "event":
                return out + self._fail(stream_exception(self._route, message), before_content)
            try:
                event = anthropic_event(message)
            except Malformed as exc:
                return out + self._fail(UpstreamError(str(exc), retryable=False), before_content)
            if event is None:
                continue
            kind = str(event.get("type") or "")
            if kind == "content_block_delta":
                self._content = True
            out.append(
                b"event: " + kind.encode()[:64] + b"\ndata: " + orjson.dumps(event) + b"\n\n"
            )
        return out

    def _fail(self, error: UpstreamError, before_content: bool) -> list[bytes]:
        self._done = True
        if before_content:  # nothing went out yet: the door answers with the error's status
            raise error
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": error.message}}
        return [b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"]

    def close(self) -> None:
        self._reader.close()
