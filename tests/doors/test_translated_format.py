"""A translated answer is built from the upstream events' payloads, never from the chat bytes
the relay would have written: the same events with their bytes blanked translate the same."""

from __future__ import annotations

import orjson

from gateway.doors.translated import MessagesShape, ResponsesShape, TranslatedFormat
from gateway.sse import DONE_DATA
from gateway.upstreams.base import OutEvent
from tests.support.waiting import named_events

CHUNKS = [
    {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "lo"}}]},
    {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
]


def _events(blank: bool) -> list[OutEvent]:
    """The upstream's events as an OpenAI route yields them (payload read lazily), or with
    their client bytes blanked (payload only)."""
    out = []
    for chunk in CHUNKS:
        data = orjson.dumps(chunk)
        event = OutEvent.unread(b"data: " + data + b"\n\n", data)
        if blank:
            event.resolve()
            event.raw = b"data: {}\n\n"
        out.append(event)
    out.append(OutEvent(b"data: [DONE]\n\n", done=True, data=DONE_DATA))
    return out


def _translate(shape_factory, blank: bool) -> bytes:
    answer = TranslatedFormat(shape_factory())
    return b"".join(answer.events([event], keep_usage=False) for event in _events(blank))


def test_messages_are_built_from_payloads_not_bytes():
    made = _translate(lambda: MessagesShape("claude-x"), blank=False)
    assert made == _translate(lambda: MessagesShape("claude-x"), blank=True)
    events = named_events(made.decode())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    text = "".join(
        data["delta"].get("text", "") for name, data in events if name == "content_block_delta"
    )
    assert text == "Hello"
    (delta,) = [data for name, data in events if name == "message_delta"]
    assert delta["usage"]["output_tokens"] == 2


def test_responses_are_built_from_payloads_not_bytes():
    request = {"model": "claude-x", "input": "Hi", "stream": True}
    made = _translate(lambda: ResponsesShape(request, "claude-x"), blank=False)
    assert made == _translate(lambda: ResponsesShape(request, "claude-x"), blank=True)
    names = [name for name, _ in named_events(made.decode())]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert names.count("response.output_text.delta") == 2


def test_a_failure_is_the_apis_error_event_and_ends_the_answer():
    answer = TranslatedFormat(MessagesShape("claude-x"))
    first = answer.events(_events(blank=False)[:2], keep_usage=False)
    failed = answer.failure("upstream timed out mid-stream", "timeout_error")
    assert b"content_block_delta" in first
    ((name, data),) = named_events(failed.decode())
    assert name == "error" and "timed out" in data["error"]["message"]
    assert answer.done() == b""  # nothing after the error
