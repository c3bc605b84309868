"""`BedrockEventStream` and `MessagesSSE` over scripted reads: what is raised before the first
content goes out, and what becomes an in-stream error after it."""

from __future__ import annotations

import orjson
import pytest

from gateway.translation.anthropic import AnthropicStreamTranslator
from gateway.translation.converse_to_chat import ConverseStreamTranslator
from gateway.upstreams.aws_eventstream import AwsMessage
from gateway.upstreams.base import UpstreamError
from gateway.upstreams.bedrock_stream import (
    AnthropicChunks,
    BedrockEventStream,
    ConverseChunks,
    MessagesSSE,
)


class ScriptedReader:
    """Reads as the test lists them; each a list of messages, then the end of the body."""

    def __init__(self, *reads: list[AwsMessage]) -> None:
        self.reads = list(reads)
        self.at_end = False
        self.closed = False
        self.resp = type("Resp", (), {"raw_headers": ((b"x-amzn-requestid", b"r-1"),)})()

    async def next(self) -> list[AwsMessage]:
        if not self.reads:
            self.at_end = True
            return []
        return self.reads.pop(0)

    def close(self) -> None:
        self.closed = True


def converse(name: str, payload: dict) -> AwsMessage:
    return AwsMessage("event", name, orjson.dumps(payload))


START = converse("messageStart", {"role": "assistant"})
HELLO = converse("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hello"}})
THROTTLE = AwsMessage("exception", "throttlingException", b'{"message": "slow down"}')


def chat_stream(*reads: list[AwsMessage]) -> BedrockEventStream:
    source = ConverseChunks(ConverseStreamTranslator("m", created=1, request_id="chatcmpl-1"))
    return BedrockEventStream(ScriptedReader(*reads), source, "bedrock", None)  # type: ignore[arg-type]


async def test_a_throttle_in_the_read_that_brought_the_first_content_is_raised_as_a_429():
    stream = chat_stream([START], [HELLO, THROTTLE])
    with pytest.raises(UpstreamError) as caught:
        await stream.open()
    assert caught.value.status == 429 and caught.value.retryable
    assert orjson.loads(caught.value.body)["error"]["type"] == "rate_limit_error"


async def test_a_throttle_after_content_went_out_is_an_error_event_then_the_end():
    stream = chat_stream([START, HELLO], [THROTTLE])
    await stream.open()
    batches = [batch async for batch in stream]
    assert any(event.content for event in batches[0])
    (error,) = batches[-1]
    assert error.error and "throttlingException" in error.chunk["error"]["message"]


async def test_a_body_cut_before_message_stop_is_an_error_event():
    stream = chat_stream([START, HELLO])
    await stream.open()
    batches = [batch async for batch in stream]
    assert batches[-1][-1].error and "ended before" in batches[-1][-1].chunk["error"]["message"]


async def test_converse_ends_after_metadata_with_done_and_reads_nothing_more():
    stop = converse("messageStop", {"stopReason": "end_turn"})
    meta = converse("metadata", {"usage": {"inputTokens": 3, "cacheReadInputTokens": 1024}})
    reader = ScriptedReader([START, HELLO], [stop, meta], [HELLO])
    source = ConverseChunks(ConverseStreamTranslator("m", created=1, request_id="chatcmpl-1"))
    stream = BedrockEventStream(reader, source, "bedrock", None)  # type: ignore[arg-type]
    await stream.open()
    batches = [batch async for batch in stream]
    assert any(event.content for event in batches[0])  # the batch held for the status line
    flat = [event for batch in batches for event in batch]
    assert flat[-1].done and flat[-2].usage["prompt_tokens_details"]["cached_tokens"] == 1024
    assert reader.reads == [[HELLO]]  # nothing after metadata was read


async def test_messages_sse_reframes_chunks_and_raises_an_early_throttle():
    def chunk(event: dict) -> AwsMessage:
        import base64

        return AwsMessage(
            "event",
            "chunk",
            orjson.dumps({"bytes": base64.b64encode(orjson.dumps(event)).decode()}),
        )

    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Hi"},
    }
    answer = MessagesSSE(
        ScriptedReader([chunk({"type": "message_start", "message": {}})], [chunk(delta)]), "b"
    )  # type: ignore[arg-type]
    await answer.open()
    out = b"".join([part async for part in answer.chunks()])
    assert out.startswith(b"event: message_start\ndata: ")
    assert b"event: content_block_delta\ndata: " + orjson.dumps(delta) + b"\n\n" in out
    assert answer.raw_headers == ((b"x-request-id", b"r-1"),)
    throttled = MessagesSSE(ScriptedReader([THROTTLE]), "b")  # type: ignore[arg-type]
    with pytest.raises(UpstreamError) as caught:
        await throttled.open()
    assert caught.value.status == 429


def test_claude_chunks_feed_the_anthropic_translator():
    import base64

    translator = AnthropicStreamTranslator("m", include_usage=True, created=1, request_id="c")
    source = AnthropicChunks(translator)
    stop = {"type": "message_stop", "amazon-bedrock-invocationMetrics": {"inputTokenCount": 1}}
    message = AwsMessage(
        "event", "chunk", orjson.dumps({"bytes": base64.b64encode(orjson.dumps(stop)).decode()})
    )
    source.feed(message)
    assert source.ended and source.whole
