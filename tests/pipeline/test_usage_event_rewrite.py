"""Only the usage-bearing event of a chat stream is read before it is written, and only it is
re-encoded (when its provider reports cached tokens in its own field): every other event goes
out as the very bytes the upstream sent, unread."""

from __future__ import annotations

import orjson

from gateway.pipeline.answer import CHAT
from gateway.upstreams.base import OutEvent


def unread(payload: bytes) -> OutEvent:
    return OutEvent.unread(b"data: " + payload + b"\n\n", payload)


CONTENT = b'{"choices":[{"index":0,"delta":{"content":"\\"usage\\": 3"}}],"usage":null}'
OPENAI_USAGE = (
    b'{"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}'
)
DEEPSEEK_USAGE = b'{"choices":[],"usage":{"prompt_tokens":1100,"prompt_cache_hit_tokens":1024}}'


def test_content_events_are_written_unread_and_unchanged():
    events = [unread(CONTENT), unread(CONTENT)]
    raws = [event.raw for event in events]
    for keep_usage in (True, False):
        assert CHAT.events(events, keep_usage) == b"".join(raws)
        assert CHAT.events(events[:1], keep_usage) is raws[0]
    assert not any(event.resolved for event in events)


def test_an_openai_usage_event_keeps_its_bytes():
    event = unread(OPENAI_USAGE)
    raw = event.raw
    assert CHAT.events([event], True) is raw
    assert CHAT.events([unread(OPENAI_USAGE)], False) == b""


def test_a_deepseek_usage_event_is_rewritten_with_openai_s_field():
    content, usage = unread(CONTENT), unread(DEEPSEEK_USAGE)
    out = CHAT.events([content, usage], True)
    assert out.startswith(content.raw)
    rewritten = orjson.loads(out[len(content.raw) :].removeprefix(b"data: "))
    assert rewritten["usage"]["prompt_tokens_details"] == {"cached_tokens": 1024}
    assert rewritten["usage"]["prompt_cache_hit_tokens"] == 1024
    assert usage.usage["prompt_tokens_details"]["cached_tokens"] == 1024
    assert not content.resolved
    assert CHAT.events([unread(DEEPSEEK_USAGE)], False) == b""
