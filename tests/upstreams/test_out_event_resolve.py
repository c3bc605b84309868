"""An event's fields, read once after it is written: the short way for a one-choice chunk reads
the same as the general way, whatever the chunk holds."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.telemetry.usage import with_chat_usage
from gateway.upstreams.base import (
    OutEvent,
    chunk_finishes,
    chunk_has_content,
    usage_from_chunk,
)

deltas = st.fixed_dictionaries(
    {},
    optional={
        "role": st.just("assistant"),
        "content": st.sampled_from(["", "hi", None]),
        "tool_calls": st.sampled_from([[], [{"index": 0}], None]),
        "reasoning_content": st.sampled_from(["", "think"]),
        "refusal": st.sampled_from([None, "no"]),
    },
)
choices = st.fixed_dictionaries(
    {"index": st.just(0)},
    optional={
        "delta": deltas | st.sampled_from([None, "text"]),
        "text": st.sampled_from(["", "t", None]),
        "finish_reason": st.sampled_from([None, "stop", "length", ""]),
        "usage": st.just({"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2}),
    },
)
usages = st.sampled_from(
    [
        None,
        {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        {"prompt_tokens": 5, "completion_tokens": 2, "prompt_cache_hit_tokens": 4},
    ]
)
chunks = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.lists(choices | st.just("odd"), max_size=2) | st.just(None),
        "usage": usages,
        "error": st.just({"message": "boom"}),
    },
)


@settings(max_examples=300, deadline=None)
@given(chunks)
def test_the_short_way_reads_what_the_general_way_reads(chunk: dict) -> None:
    data = orjson.dumps(chunk)
    event = OutEvent.unread(b"data: " + data + b"\n\n", data).resolve()
    if "error" in chunk and "choices" not in chunk:
        assert event.error
        return
    expected = with_chat_usage(chunk) or chunk
    assert event.content == chunk_has_content(expected)
    assert event.finish == chunk_finishes(expected)
    assert event.usage == usage_from_chunk(expected)
    assert event.usage_only == (event.usage is not None and not expected.get("choices"))
    assert not event.malformed and not event.done
