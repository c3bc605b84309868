"""The read loop of an upstream whose SSE events are translated into OpenAI chunks.

The `anthropic` and `gemini` kinds (and `vertex`, which speaks both) read the same way: parse
each network read into SSE events within `max_event_bytes`, hand them to the kind's
`_translate`, yield what came out as one batch, and stop once `_translate` says the stream is
over. Only how an event translates and how the stream finishes differ, so those are the two
methods a kind writes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.sse import EventTooLarge, SSEEvent, SSEParser
from gateway.upstreams.base import (
    Diverted,
    OnBatch,
    OutEvent,
    UpstreamError,
    UpstreamResponse,
    end_answer,
    event_too_large,
    relayed_headers,
)
from gateway.upstreams.diverted import DivertedReads
from gateway.upstreams.http1 import Http1Response


class TranslatedEventStream:
    """An `EventStream` over a translated SSE answer; subclasses give `_translate` and
    `_finish`."""

    def __init__(self, resp: UpstreamResponse, max_event_bytes: int, route: str) -> None:
        self._resp = resp
        self._parser = SSEParser(max_event_bytes)
        self._route = route
        self.relayed = relayed_headers(resp.raw_headers)
        self.answered = False  # the upstream's own end of the answer came
        self._over = False  # the batch `__aiter__` read last ended the stream

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        async for chunk in self._resp.content.iter_any():
            out, ended, failure = self._step(chunk)
            self._over = ended or failure is not None
            if out:
                yield out
            if failure is not None:
                raise failure
            if ended:
                return
        yield self._tail()

    def divert(self, on_batch: OnBatch) -> Diverted | None:
        """Hand each read's batch to `on_batch` as it arrives (see `Diverted`), for an answer on
        the gateway's own HTTP/1.1 client; None for any other."""
        if not isinstance(self._resp, Http1Response) or self._over:
            return None  # the batch read last ended the stream: `__aiter__` ends it
        return DivertedReads(self._resp, on_batch, self._step, _never, self._tail)

    def _step(self, chunk: bytes) -> tuple[list[OutEvent], bool, UpstreamError | None]:
        """One read's translation, and whether the stream is over; an event past the limit ends
        it after the events before it, unless they ended it already."""
        try:
            events = self._parser.feed(chunk)
        except EventTooLarge as exc:
            out, ended = self._translate(exc.events)
            return out, True, None if ended else event_too_large(self._route, exc.limit)
        out, ended = self._translate(events)
        # Marked before the reader sees it: a reader stops at the end without resuming us.
        self.answered = ended and not (out and out[-1].error)
        return out, ended, None

    def _tail(self) -> list[OutEvent]:
        """The last batch, once the upstream closed: the flushed events and the kind's ending."""
        out, ended = self._translate(self._parser.flush())
        return self._finish(out, ended)

    def _translate(self, events: list[SSEEvent]) -> tuple[list[OutEvent], bool]:
        """OpenAI events for these upstream events, and whether the stream is over."""
        raise NotImplementedError

    def _finish(self, out: list[OutEvent], ended: bool) -> list[OutEvent]:
        """The last batch, once the upstream closed: `out` (the flushed events' translation)
        plus what the kind adds; `ended`: whether those events already ended the stream."""
        raise NotImplementedError

    def _error(self, message: str) -> OutEvent:
        return OutEvent.failure(f"route {self._route!r}: {message}")

    async def aclose(self) -> None:
        end_answer(self._resp, self.answered)


def _never(_: list[OutEvent]) -> bool:
    return False  # a translated stream knows it is over when it translates the last event
