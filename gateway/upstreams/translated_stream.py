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
    OutEvent,
    UpstreamResponse,
    end_answer,
    event_too_large,
    relayed_headers,
)


class TranslatedEventStream:
    """An `EventStream` over a translated SSE answer; subclasses give `_translate` and
    `_finish`."""

    def __init__(self, resp: UpstreamResponse, max_event_bytes: int, route: str) -> None:
        self._resp = resp
        self._max_event_bytes = max_event_bytes
        self._route = route
        self.relayed = relayed_headers(resp.raw_headers)
        self.answered = False  # the upstream's own end of the answer came

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        parser = SSEParser(self._max_event_bytes)
        async for chunk in self._resp.content.iter_any():
            try:
                events = parser.feed(chunk)
            except EventTooLarge as exc:
                out, ended = self._translate(exc.events)
                if out:
                    yield out
                if ended:
                    return
                raise event_too_large(self._route, exc.limit) from None
            out, ended = self._translate(events)
            # Marked before the yield: a reader stops at the end without resuming us.
            self.answered = ended and not (out and out[-1].error)
            if out:
                yield out
            if ended:
                return
        out, ended = self._translate(parser.flush())
        yield self._finish(out, ended)

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
