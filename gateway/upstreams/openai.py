"""The `openai` upstream kind: any OpenAI-compatible server.

Event bytes go to the client exactly as received, but for the usage event (and a completion's
usage) of a provider that reports cached tokens in its own field (`gateway.telemetry.usage`).
The HTTP side (pooled session, limits, no redirects) is `UpstreamHttp`'s; this module knows
the OpenAI paths and answer shapes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.paths import PassPath
from gateway.sse import DEFAULT_MAX_EVENT_BYTES, DONE_DATA, EventTooLarge, SSEEvent, SSEParser
from gateway.telemetry.usage import with_chat_usage
from gateway.upstreams.base import (
    CallContext,
    Completed,
    Diverted,
    ModelCard,
    OnBatch,
    OutEvent,
    UpstreamBody,
    UpstreamError,
    UpstreamResponse,
    encode_body,
    end_answer,
    event_too_large,
    relayed_headers,
    usage_from_chunk,
)
from gateway.upstreams.diverted import DivertedReads
from gateway.upstreams.http import RemoteUpstream, json_object_body
from gateway.upstreams.http1 import Http1Response

log = logging.getLogger("firsttoken.upstream")

ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}


class OpenAIUpstream(RemoteUpstream):
    """Any OpenAI-compatible server: the request and its answer pass through as they are."""

    def __init__(self, route: Route, *, api_key: str | None, **options: Any) -> None:
        """`options`: those of `RemoteUpstream` (pool size, timeouts, byte limits)."""
        super().__init__(route, self.auth_headers(api_key), **options)

    @staticmethod
    def auth_headers(api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def endpoint_path(self, endpoint: str, ctx: CallContext) -> str:
        """The path (after the base URL, query included) a chat or completions request goes to."""
        return ENDPOINT_PATHS[endpoint]

    async def model_cards(self) -> list[ModelCard]:
        return [
            {"object": "model", "created": 0, "owned_by": self.route.name, **item}
            for item in await self.http.model_list()
        ]

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        return await self.http.forward(method, path, headers, data)

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> OpenAIEventStream:
        http = self.http
        path = self.endpoint_path(ctx.endpoint, ctx)
        resp = await http.post(path, encode_body(body), ctx.forward_headers)
        http.expect(resp, stream=True)
        return OpenAIEventStream(resp, self.max_event_bytes, self.route.name)

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed:
        http = self.http
        path = self.endpoint_path(ctx.endpoint, ctx)
        resp = await http.post(path, encode_body(body), ctx.forward_headers)
        http.expect(resp, stream=False)
        raw = await http.read_body(resp)
        parsed = json_object_body(raw, self.route.name)
        fixed = with_chat_usage(parsed)
        if fixed is not None:  # cached tokens in a provider's own field: in OpenAI's too
            parsed, raw = fixed, orjson.dumps(fixed)
        return Completed(
            resp.status,
            raw,
            resp.headers.get("content-type", "application/json"),
            usage_from_chunk(parsed),
            relayed_headers(resp.raw_headers),
        )


class OpenAIEventStream:
    """Upstream SSE bytes -> `OutEvent`s, one list per network read.

    It stops reading at `[DONE]`; an event whose data is not a JSON object becomes an error
    event and ends the stream, as does an event past `max_event_bytes`."""

    def __init__(
        self,
        resp: UpstreamResponse,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        route: str = "upstream",
    ) -> None:
        self._resp = resp
        self._parser = SSEParser(max_event_bytes)
        self._route = route
        self.relayed = relayed_headers(resp.raw_headers)
        self.answered = False  # `[DONE]` came: the answer ended as the protocol says
        # What `__aiter__` read last: the batch it yielded and a failure it raises next
        self._last: tuple[list[OutEvent], UpstreamError | None] = ([], None)

    async def __aiter__(self) -> AsyncIterator[list[OutEvent]]:
        async for chunk in self._resp.content.iter_any():
            out, _, failure = self._step(chunk)
            self._last = (out, failure)
            if out:
                yield out
                if _over(out):
                    return
            if failure is not None:
                raise failure
        tail = self._tail()
        if tail:
            yield tail

    def divert(self, on_batch: OnBatch) -> Diverted | None:
        """Hand each read's batch to `on_batch` as it arrives (see `Diverted`), for an answer on
        the gateway's own HTTP/1.1 client; None for any other (aiohttp's)."""
        out, failure = self._last
        if not isinstance(self._resp, Http1Response) or failure is not None or (out and _over(out)):
            return None  # the batch read last ended the stream: `__aiter__` ends it
        return DivertedReads(self._resp, on_batch, self._step, _over, self._tail)

    def _step(self, chunk: bytes) -> tuple[list[OutEvent], bool, UpstreamError | None]:
        """The events one read completes (none while an event is still partial); an event past
        the limit ends the stream after the events before it."""
        parser = self._parser
        whole = None if parser.holding else json_events(chunk, parser.limit)
        if whole is not None:
            # The usual read while a model streams: whole events, one `data:` line each.
            return [OutEvent.unread(raw, raw[6:-2]) for raw in whole], False, None
        try:
            events = parser.feed(chunk)
        except EventTooLarge as exc:
            out = self._out(exc.events) if exc.events else []
            return out, True, event_too_large(self._route, exc.limit)
        if not events:
            return [], False, None
        out = self._out(events)
        # Marked before the reader sees it: a reader stops at `[DONE]` without resuming us.
        self.answered = out[-1].done
        return out, False, None

    def _tail(self) -> list[OutEvent] | None:
        """The body ended: its unterminated last event, if any."""
        tail = self._parser.flush()
        return self._out(tail) if tail else None

    def _out(self, events: list[SSEEvent]) -> list[OutEvent]:
        """Events as the client gets them, cut after `[DONE]` or a malformed event. Only the
        first byte of each payload is looked at here; the full parse comes after the write."""
        out = []
        for e in events:
            data = e.data
            if data is not None and data[:1] != b"{":
                stripped = data.strip()
                if stripped == DONE_DATA:
                    out.append(OutEvent(e.raw, done=True))
                    return out
                if not stripped.startswith(b"{"):
                    out.append(
                        OutEvent.failure(f"upstream {self._route!r} sent an event that is not JSON")
                    )
                    return out
            out.append(OutEvent.unread(e.raw, data))
        return out

    async def aclose(self) -> None:
        end_answer(self._resp, self.answered)  # `[DONE]` is OpenAI's end of the answer


def _over(out: list[OutEvent]) -> bool:
    """After its reader has read a batch: the stream ended with it (`[DONE]`, an error)."""
    return out[-1].done or out[-1].error


def json_events(chunk: bytes, limit: int) -> list[bytes] | None:
    """The events of `chunk` when it is whole SSE events of a single `data: {...}` line each (no
    other line, no CR), none over `limit` bytes: what `SSEParser` would make of it is then known
    without parsing. None for anything else."""
    if chunk[:7] != b"data: {" or chunk[-2:] != b"\n\n" or b"\r" in chunk:
        return None
    if chunk.find(b"\n") == len(chunk) - 2:
        return [chunk] if len(chunk) <= limit else None
    parts = chunk[:-2].split(b"\n\n")
    for part in parts:
        if part[:7] != b"data: {" or b"\n" in part or len(part) + 2 > limit:
            return None
    return [part + b"\n\n" for part in parts]
