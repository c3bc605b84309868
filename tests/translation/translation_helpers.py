"""Chat answers to feed the chat -> Messages and chat -> Responses translators, and readers of
what they write: both must take the same upstream bytes, so the tests build them once."""

from __future__ import annotations

from typing import Protocol

import httpx2
import orjson

USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 100},
}

# Chunks an untrusted upstream might send before a good one; each must be ignored.
JUNK_CHUNKS: list = [
    "nope",
    {"choices": "x"},
    {"choices": [{"delta": {"content": 5, "tool_calls": "y"}}]},
    {"choices": [{"delta": {"tool_calls": [{"index": "z", "function": 3}]}}]},
]


def completion(message: dict, finish_reason: str = "stop", usage: object = USAGE) -> dict:
    """A whole `chat.completion` answering `message`."""
    return {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "upstream-model-2025",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage,
    }


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    """One `chat.completion.chunk`; no delta means no choice (a usage-only chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-s1",
        "object": "chat.completion.chunk",
        "created": 1700000001,
        **extra,
    } | {"choices": choices}


def tool_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None):
    """A tool-call delta; the first of a call carries its id and name."""
    call: dict = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def realistic_chunks(usage: dict) -> list[dict]:
    """Text, then a tool call streamed in fragments, the finish chunk, then the usage chunk."""
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk(tool_delta(0, "", "call_1", "weather")),
        chunk(tool_delta(0, '{"ci')),
        chunk(tool_delta(0, 'ty": "Par')),
        chunk(tool_delta(0, 'is"}')),
        chunk({}, "tool_calls"),
        chunk(None, usage=usage),
    ]


class ChatStream(Protocol):
    def feed(self, chunk: dict) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


def feed_all(stream: ChatStream, chunks: list[dict]) -> list[bytes]:
    """Every event `stream` writes for `chunks`, then its end; a second end writes nothing."""
    out: list[bytes] = []
    for c in chunks:
        out.extend(stream.feed(c))
    out.extend(stream.finish())
    assert stream.finish() == []
    return out


def parse_sse(events: list[bytes]) -> list[tuple[str, dict]]:
    """Each event as (name, data), checking it is one whole named event led by its `type`."""
    parsed = []
    for event in events:
        assert event.endswith(b"\n\n") and event.count(b"\n\n") == 1
        name_line, data_line = event[:-2].split(b"\n")
        assert name_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        name = name_line[len(b"event: ") :].decode()
        data = orjson.loads(data_line[len(b"data: ") :])
        assert next(iter(data)) == "type" and data["type"] == name
        parsed.append((name, data))
    return parsed


def sse_http_client(body: bytes) -> httpx2.Client:
    """An HTTP client (for an SDK) whose every request is answered with `body` as an SSE
    stream, offline."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return httpx2.Client(transport=httpx2.MockTransport(answer))


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict:
    """A chat assistant message's tool call, as the translators write it and upstreams send it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
