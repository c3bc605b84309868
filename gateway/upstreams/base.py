"""What every upstream kind offers the proxy, and the failures the proxy may retry.

An upstream turns an OpenAI-format request into a stream of `OutEvent`s: the bytes the client
gets, plus the few facts the proxy needs (does it carry content, usage) so that the proxy never
re-parses what an upstream already understood.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.config.routes import Route
from gateway.errors import error_body
from gateway.sse import DONE_DATA, encode_data
from gateway.telemetry.usage import with_chat_usage

if TYPE_CHECKING:
    import aiohttp

    from gateway.paths import PassPath


# The header that names a request, the upstream's or the gateway's own.
REQUEST_ID_HEADER = b"x-request-id"


class BodyReader(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class UpstreamResponse(Protocol):
    """What the upstream kinds read of an answer: aiohttp's `ClientResponse` and `Http1Response`
    both are one."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> BodyReader: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def release(self) -> Any: ...


def end_answer(resp: UpstreamResponse, answered: bool) -> None:
    """Done reading an event stream's answer: its connection goes back to the pool when the
    answer ended as its protocol says (what may follow is the body's terminator); after any
    other end it is closed, so a half-read answer never goes back and the upstream sees the
    connection drop at once."""
    if resp.closed:
        return
    if answered:
        resp.release()
    else:
        resp.close()


@dataclass(slots=True)
class OutEvent:
    raw: bytes  # SSE-framed bytes for the client
    content: bool = False  # carries text, a tool-call delta or reasoning
    usage: dict | None = None
    usage_only: bool = False  # the include_usage chunk (choices == [])
    done: bool = False  # data: [DONE]
    error: bool = False  # an in-stream error (from upstream, or ours about it)
    finish: bool = False  # a choice carries a finish_reason
    malformed: bool = False  # the payload is not a JSON object: the stream cannot go on
    data: bytes | None = None  # the `data:` payload, while the fields above are not yet read
    resolved: bool = True
    chunk: dict | None = None  # the payload as a JSON object, once read (or as built)

    @classmethod
    def failure(cls, message: str, type: str = "upstream_error") -> OutEvent:
        """An in-stream error event; its payload is kept so that a door translating the
        stream into another API reads the message without parsing bytes again."""
        payload = error_body(message, type)
        return cls(encode_data(payload), error=True, chunk=payload)

    @classmethod
    def of_chunk(cls, chunk: dict) -> OutEvent:
        """An event the gateway built from a chat chunk (a translated or local upstream)."""
        chunk = with_chat_usage(chunk) or chunk
        usage = usage_from_chunk(chunk)
        choices = chunk.get("choices")
        return cls(
            encode_data(chunk),
            content=chunk_has_content(chunk),
            usage=usage,
            usage_only=usage is not None and not choices,
            finish=chunk_finishes(chunk),
            chunk=chunk,
        )

    def payload(self) -> dict | None:
        """The event's JSON object (None for `[DONE]`, a keepalive or a malformed event)."""
        if self.chunk is None and not self.resolved:
            self.resolve()
        return self.chunk

    @classmethod
    def unread(cls, raw: bytes, data: bytes | None) -> OutEvent:
        """An event forwarded as received; its JSON is parsed only when someone asks."""
        return cls(raw, data=data, resolved=False)

    def is_usage_only(self) -> bool:
        """Whether this is the include_usage chunk. An unread event is parsed only when its
        bytes mention a usage value, so most events go out without being read first; one that
        does is read (and its usage put in OpenAI's shape, ``raw`` rewritten) before it goes
        out."""
        if not self.resolved:
            data = self.data
            if (
                data is not None
                and b'"usage"' in data
                and b'"usage":null' not in data
                and b'"usage": null' not in data
            ):
                self.resolve()
        return self.usage_only

    def resolve(self) -> OutEvent:
        """Parse the payload once and fill the fields the proxy and telemetry read."""
        if self.resolved:
            return self
        self.resolved = True
        data = self.data
        if data is None:
            return self
        if data == DONE_DATA:
            self.done = True
            return self
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            self.malformed = True
            return self
        self.chunk = chunk
        choices = chunk.get("choices")
        if chunk.get("usage") is None and type(choices) is list and len(choices) == 1:
            # What a model streams: one choice's delta and no usage (read with fewer steps,
            # as this runs for every token).
            choice = choices[0]
            if type(choice) is dict and "usage" not in choice:
                self.content = choice_has_content(choice)
                self.finish = bool(choice.get("finish_reason"))
                return self
        if "error" in chunk and "choices" not in chunk:
            self.error = True
            return self
        fixed = with_chat_usage(chunk)
        if fixed is not None:
            # A provider that reports cached tokens in its own field: the client gets them in
            # OpenAI's field too. Only the (one) usage event is re-encoded.
            chunk = fixed
            self.raw = encode_data(fixed)
        self.chunk = chunk
        self.usage = usage_from_chunk(chunk)
        self.content = chunk_has_content(chunk)
        self.finish = chunk_finishes(chunk)
        self.usage_only = self.usage is not None and not chunk.get("choices")
        return self


@dataclass(slots=True)
class CallContext:
    """Per-request facts an upstream may need besides the body."""

    endpoint: str  # "chat" | "completions"
    tenant: str
    upstream_model: str
    request_id: str  # the gateway's own, unique per request (never a client's x-request-id)
    forward_headers: dict[str, str] = field(default_factory=dict)
    client_model: str = ""  # the name the client asked for, which answers carry
    hedged: bool = False  # set by a replicated route that sent this request twice


@dataclass(slots=True)
class Completed:
    status: int
    body: bytes
    content_type: str
    usage: dict | None
    headers: list[tuple[bytes, bytes]] | None = None  # upstream rate-limit headers to relay


class UpstreamError(Exception):
    """A failure before the first byte; `retryable` tells the proxy whether to try again."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        retryable: bool = True,
        body: bytes | None = None,
        content_type: str | None = None,
        retry_after: float | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.body = body
        self.content_type = content_type
        self.retry_after = retry_after
        self.headers = headers  # Retry-After and rate-limit headers the client should see


def client_error(message: str, param: str | None = None) -> UpstreamError:
    """A request this upstream kind cannot take: a 400 with an OpenAI body, never retried (the
    same body would fail the same way on every route)."""
    body = orjson.dumps(error_body(message, "invalid_request_error", param))
    return UpstreamError(
        message, status=400, retryable=False, body=body, content_type="application/json"
    )


class EncodedBody(dict):
    """An upstream body already encoded (by a big-body worker process): as a dict it carries
    only `model` and `stream`, for the proxy; `encode_body` sends `encoded` as it is."""

    __slots__ = ("encoded",)

    def __init__(self, encoded: bytes, model: str, stream: bool) -> None:
        super().__init__(model=model, stream=stream)
        self.encoded = encoded


# The body an upstream gets: OpenAI-format JSON, policies applied, `model` the upstream's name.
UpstreamBody = dict[str, Any]
# One entry of `GET /v1/models`: OpenAI's card shape (`id`, `object`, `created`, `owned_by`).
ModelCard = dict[str, Any]


def encode_body(body: UpstreamBody) -> bytes:
    """The upstream request's bytes; a body orjson cannot write (nesting past its limit, an
    integer past 64 bits) is the client's error, not the upstream's."""
    if isinstance(body, EncodedBody):
        return body.encoded
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        raise client_error(f"the request body cannot be encoded as JSON ({exc})") from None


class UpstreamTimeout(UpstreamError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=504, retryable=True)


class EventStream(Protocol):
    """Batches of events, one per upstream read. It ends after `[DONE]` (nothing after it is
    read) or with an error event when the upstream breaks its protocol. `relayed`: upstream
    response headers for the client (rate limits), or None; the proxy reads it with getattr so
    a kind without response headers may leave it out."""

    relayed: list[tuple[bytes, bytes]] | None

    def __aiter__(self) -> AsyncIterator[list[OutEvent]]: ...
    async def aclose(self) -> None: ...


# A reader's function for a diverted stream's batches: True when it wants nothing more.
OnBatch = Callable[[list[OutEvent]], bool]


class Diverted(Protocol):
    """An event stream that hands each read's batch to its reader's function as it arrives
    (`divert`), from the connection's read callback: no task wakes up per read. The reader
    waits once, in `ended`."""

    async def ended(self) -> None:
        """Until the stream is over: the function wanted nothing more, or the body ended (its
        last unterminated event delivered first). Raises what reading it would have raised."""
        ...

    def pause(self) -> None:
        """Stop reading from the upstream (the reader's own client is slow)."""
        ...

    def resume(self) -> None: ...

    def stop(self) -> None:
        """Nothing more goes to the function (the reader is done, whichever way)."""
        ...


async def close_iterator(iterator: object) -> None:
    """Close the iterator of an event stream whose reader stopped early (at `[DONE]`, on a
    failure): an async generator left suspended is handed to the event loop to finalize, a
    wake-up and a task per stream, and its cleanup then runs at no defined time."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class Upstream(Protocol):
    """The one contract between the gateway and an upstream kind (`openai`, `azure`,
    `anthropic`, `gemini`, `vertex`, `bedrock`, `local`, and the replicated and pd routes). The
    proxy, the app and passthrough use nothing else of an upstream."""

    route: Route

    async def start(self) -> None:
        """Acquire what requests need (a connection pool, a loaded model)."""

    async def warm_up(self) -> None:
        """Optional work that makes the first request faster; a failure here is logged only."""

    async def aclose(self) -> None: ...

    async def model_cards(self) -> list[ModelCard]:
        """The models the upstream itself lists (may be cached, may be empty)."""

    async def open_stream(self, body: UpstreamBody, ctx: CallContext) -> EventStream: ...

    async def complete(self, body: UpstreamBody, ctx: CallContext) -> Completed: ...

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        """A raw passthrough request (`/v1/files`, `/v1/embeddings`, ...) to the route's
        origin with its credentials; kinds that forward nothing raise `no_forward`."""


def event_too_large(route_name: str, limit: int) -> UpstreamError:
    """An upstream SSE event past FIRSTTOKEN_MAX_EVENT_BYTES: the stream cannot go on."""
    return UpstreamError(
        f"upstream {route_name!r} sent an event over {limit} bytes", status=502, retryable=False
    )


def no_forward(route: Route) -> UpstreamError:
    """What `forward` raises on a kind that has no raw HTTP API behind it."""
    return UpstreamError(
        f"route {route.name!r} ({route.kind}) forwards no other /v1 paths",
        status=404,
        retryable=False,
    )


def retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


# Response headers relayed to the client: what it needs to pace itself against the provider,
# and the provider's id of the request (what its support asks for). Anthropic's `request-id`
# reaches the client as `x-request-id`, the name the OpenAI SDK reads.
RELAYED_PREFIXES = (b"x-ratelimit-", b"anthropic-ratelimit-")
RELAYED_NAMES = {
    b"x-request-id": b"x-request-id",
    b"request-id": b"x-request-id",
    b"openai-processing-ms": b"openai-processing-ms",
}
RETRY_HEADERS = frozenset({b"retry-after", b"retry-after-ms"})
MAX_RELAYED_HEADERS = 32
_RELAYED_FIRST = frozenset(b"xXaAoOrR")  # first bytes of the names above, either case


def relayed_headers(
    raw_headers: tuple[tuple[bytes, bytes], ...], retry: bool = False
) -> list[tuple[bytes, bytes]] | None:
    """The upstream's rate-limit and request-id headers (and, for an error, its Retry-After),
    lower-cased, at most MAX_RELAYED_HEADERS of them; None when there are none. Runs once per
    response, before the first event, so a header's first byte is checked before anything is
    lower-cased."""
    out = None
    for name, value in raw_headers:
        if not name or name[0] not in _RELAYED_FIRST:
            continue
        lower = name.lower()
        if lower.startswith(RELAYED_PREFIXES) or (retry and lower in RETRY_HEADERS):
            relayed = lower
        else:
            relayed = RELAYED_NAMES.get(lower)  # type: ignore[assignment]  # None: not relayed
            if relayed is None:
                continue
        if out is None:
            out = []
        out.append((relayed, value))
        if len(out) >= MAX_RELAYED_HEADERS:
            break
    return out


def has_request_id(headers: list[tuple[bytes, bytes]] | None) -> bool:
    return headers is not None and any(name == REQUEST_ID_HEADER for name, _ in headers)


def usage_from_chunk(chunk: dict) -> dict | None:
    usage = chunk.get("usage")
    return usage if isinstance(usage, dict) else None


def chunk_finishes(chunk: dict) -> bool:
    """True for a chunk where a choice ends (a finish_reason)."""
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("finish_reason"):
            return True
    return False


def chunk_has_content(chunk: dict) -> bool:
    """True for a chunk a user would see: text, a tool-call delta or reasoning (not role-only)."""
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice_has_content(choice):
            return True
    return False


def choice_has_content(choice: dict) -> bool:
    """`chunk_has_content` for one choice of a chunk."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("function_call")
        or delta.get("refusal")
    )
