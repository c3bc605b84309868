"""The event-stream decoder: whole messages as bytes arrive, and its limits."""

from __future__ import annotations

import pytest

from gateway.upstreams.aws_eventstream import EventStreamBroken, EventStreamDecoder
from tests.support.mock_bedrock import event, exception


def test_messages_come_out_as_they_complete_even_byte_by_byte():
    data = event("messageStart", {"role": "assistant"}) + exception("throttlingException", "slow")
    decoder = EventStreamDecoder(limit=4096)
    out = []
    first_seen_at = None
    for index in range(len(data)):
        got = decoder.feed(data[index : index + 1])
        if got and first_seen_at is None:
            first_seen_at = index
        out.extend(got)
    assert first_seen_at == len(event("messageStart", {"role": "assistant"})) - 1
    assert [(m.kind, m.name) for m in out] == [
        ("event", "messageStart"),
        ("exception", "throttlingException"),
    ]
    assert out[0].payload == b'{"role":"assistant"}' and not decoder.holding


def test_a_message_past_the_limit_or_a_bad_crc_breaks_the_stream():
    big = event("contentBlockDelta", {"delta": {"text": "x" * 5000}})
    with pytest.raises(EventStreamBroken, match="exceeded"):
        EventStreamDecoder(limit=1024).feed(big[:2048])
    corrupt = bytearray(event("messageStop", {"stopReason": "end_turn"}))
    corrupt[-1] ^= 0xFF
    with pytest.raises(EventStreamBroken, match="malformed"):
        EventStreamDecoder(limit=4096).feed(bytes(corrupt))
