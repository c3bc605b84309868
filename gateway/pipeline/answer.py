"""How the chat pipeline's answer reaches its client: as chat, or converted by a door.

The pipeline relays upstream events and whole answers through an `AnswerFormat`. For the chat
and completions doors that is `CHAT`: each event's bytes as the upstream sent them (nothing is
parsed before it is written). A door of another API (Messages, Responses) served by the chat
path passes its own format, which converts each upstream event as it arrives, from the event's
payload, never from bytes the gateway wrote itself (`gateway.doors.translated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.errors import sse_error_event
from gateway.sse import DONE, KEEPALIVE
from gateway.upstreams.base import OutEvent


class AnswerFormat(Protocol):
    """The client API's side of a chat answer."""

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        """Response headers the format adds (e.g. what a translation could not carry over)."""

    @property
    def request_id_names(self) -> Sequence[bytes]:
        """Further header names that repeat the answer's `x-request-id` (Anthropic's SDK reads
        `request-id`)."""

    def events(self, batch: list[OutEvent], keep_usage: bool) -> bytes:
        """The bytes to write for a batch of upstream events (`keep_usage`: the client asked
        for the usage chunk of a chat stream)."""

    def keepalive(self) -> bytes: ...

    def done(self) -> bytes:
        """The end of a stream that finished but lacked its own end marker."""

    def failure(self, message: str, type: str) -> bytes:
        """An in-stream failure, and the stream's end."""

    def whole(self, status: int, body: bytes) -> bytes:
        """A whole answer's body: a completion (2xx) or an OpenAI-shaped error."""


class ChatFormat:
    """Chat's own answer: the upstream's bytes, as they came, but for the event that carries
    usage, whose cached-token count is put in OpenAI's field first (``OutEvent.is_usage_only``
    reads only an event whose bytes mention usage)."""

    headers: Sequence[tuple[bytes, bytes]] = ()
    request_id_names: Sequence[bytes] = ()

    def events(self, batch: list[OutEvent], keep_usage: bool) -> bytes:
        if len(batch) == 1:
            event = batch[0]
            return b"" if event.is_usage_only() and not keep_usage else event.raw
        return b"".join(event.raw for event in batch if not event.is_usage_only() or keep_usage)

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def done(self) -> bytes:
        return DONE

    def failure(self, message: str, type: str) -> bytes:
        return sse_error_event(message, type) + DONE

    def whole(self, status: int, body: bytes) -> bytes:
        return body


CHAT = ChatFormat()
