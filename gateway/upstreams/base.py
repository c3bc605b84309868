"""What every upstream kind offers the proxy, and the failures the proxy may retry.

An upstream turns an OpenAI-format request into a stream of `OutEvent`s: the bytes the client
gets, plus the few facts the proxy needs (does it carry content, usage) so that the proxy never
re-parses what an upstream already understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import orjson

from gateway.routes import Route


@dataclass(slots=True)
class OutEvent:
    raw: bytes                  # SSE-framed bytes for the client
    content: bool = False       # carries text, a tool-call delta or reasoning
    usage: dict | None = None
    usage_only: bool = False    # the include_usage chunk (choices == [])
    done: bool = False          # data: [DONE]
    error: bool = False         # an in-stream error from upstream
    data: bytes | None = None   # the `data:` payload, while the fields above are not yet read
    resolved: bool = True

    @classmethod
    def unread(cls, raw: bytes, data: bytes | None) -> "OutEvent":
        """An event forwarded as received; its JSON is parsed only when someone asks."""
        return cls(raw, data=data, resolved=False)

    def is_usage_only(self) -> bool:
        """Whether this is the include_usage chunk. An unread event is parsed only when its
        bytes mention a usage value, so most events go out without being read first."""
        if not self.resolved:
            data = self.data
            if (data is not None and b'"usage"' in data and b'"usage":null' not in data
                    and b'"usage": null' not in data):
                self.resolve()
        return self.usage_only

    def resolve(self) -> "OutEvent":
        """Parse the payload once and fill the fields the proxy and telemetry read."""
        if self.resolved:
            return self
        self.resolved = True
        data = self.data
        if data is None:
            return self
        if data == b"[DONE]":
            self.done = True
            return self
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return self
        if not isinstance(chunk, dict):
            return self
        if "error" in chunk and "choices" not in chunk:
            self.error = True
            return self
        self.usage = usage_from_chunk(chunk)
        self.content = chunk_has_content(chunk)
        self.usage_only = self.usage is not None and not chunk.get("choices")
        return self


@dataclass(slots=True)
class CallContext:
    """Per-request facts an upstream may need besides the body."""

    endpoint: str               # "chat" | "completions"
    tenant: str
    upstream_model: str
    request_id: str
    forward_headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Completed:
    status: int
    body: bytes
    content_type: str
    usage: dict | None


class UpstreamError(Exception):
    """A failure before the first byte; `retryable` tells the proxy whether to try again."""

    def __init__(self, message: str, *, status: int = 502, retryable: bool = True,
                 body: bytes | None = None, content_type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.body = body
        self.content_type = content_type
        self.retry_after = retry_after


class UpstreamTimeout(UpstreamError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=504, retryable=True)


class EventStream(Protocol):
    def __aiter__(self) -> AsyncIterator[list[OutEvent]]: ...
    async def aclose(self) -> None: ...


class Upstream(Protocol):
    route: Route

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def open_stream(self, body: dict, ctx: CallContext) -> EventStream: ...
    async def complete(self, body: dict, ctx: CallContext) -> Completed: ...


def retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def usage_from_chunk(chunk: dict) -> dict | None:
    usage = chunk.get("usage")
    return usage if isinstance(usage, dict) else None


def chunk_has_content(chunk: dict) -> bool:
    """True for a chunk a user would see: text, a tool-call delta or reasoning (not role-only)."""
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
            or delta.get("reasoning") or delta.get("function_call") or delta.get("refusal")
        ):
            return True
    return False
