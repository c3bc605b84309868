"""What a `bedrock` route adds per request on the gateway's side, measured in process.

    .venv/bin/python bench/bedrock_overhead.py [--runs 2000]

Three costs that an `openai` route does not have, each timed alone (p50 and p99 over `--runs`
repetitions, bounded by a time limit):

- signing: `AwsSigner.sign` (botocore's SigV4 over the whole body, session token included) for
  a 2 KB, a 64 KB and a 512 KB chat body;
- framing: decoding one InvokeModel stream (message_start, 40 text deltas, message_delta,
  message_stop; each an event-stream message with the base64 of its Anthropic event) with
  `EventStreamDecoder`, fed in network-sized reads, and translating it to chat chunks;
- the same for a Converse stream of 40 deltas.

Nothing leaves the process. Prints a table; writes bench/results/bedrock_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.translation.anthropic import AnthropicStreamTranslator
from gateway.translation.converse_to_chat import ConverseStreamTranslator
from gateway.upstreams.aws_auth import AwsSigner
from gateway.upstreams.aws_eventstream import EventStreamDecoder
from gateway.upstreams.bedrock_stream import AnthropicChunks, ConverseChunks

RESULTS = Path(__file__).resolve().parent / "results" / "bedrock_overhead.json"
TIME_LIMIT_S = 20.0  # per measurement
READ_BYTES = 16 * 1024
URL = "https://bedrock-runtime.us-east-1.amazonaws.com/model/amazon.nova-pro-v1%3A0/converse"


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    encoded = b"".join(
        bytes([len(k)]) + k.encode() + b"\x07" + struct.pack(">H", len(v)) + v.encode()
        for k, v in headers.items()
    )
    prelude = struct.pack(">II", 16 + len(encoded) + len(payload), len(encoded))
    prelude += struct.pack(">I", binascii.crc32(prelude))
    message = prelude + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def event(name: str, payload: dict) -> bytes:
    return frame({":event-type": name, ":message-type": "event"}, orjson.dumps(payload))


def claude_stream(deltas: int) -> bytes:
    def chunk(e: dict) -> bytes:
        return event("chunk", {"bytes": base64.b64encode(orjson.dumps(e)).decode()})

    usage = {"input_tokens": 10, "cache_read_input_tokens": 2048, "output_tokens": 1}
    parts = [chunk({"type": "message_start", "message": {"id": "m", "usage": usage}})]
    parts += [
        chunk(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": f" word{i}"},
            }
        )
        for i in range(deltas)
    ]
    parts += [
        chunk(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": deltas},
            }
        ),
        chunk({"type": "message_stop"}),
    ]
    return b"".join(parts)


def converse_stream(deltas: int) -> bytes:
    parts = [event("messageStart", {"role": "assistant"})]
    parts += [
        event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": f" word{i}"}})
        for i in range(deltas)
    ]
    parts += [
        event("messageStop", {"stopReason": "end_turn"}),
        event("metadata", {"usage": {"inputTokens": 10, "outputTokens": deltas}}),
    ]
    return b"".join(parts)


def decode_and_translate(data: bytes, claude: bool) -> int:
    decoder = EventStreamDecoder(1024 * 1024)
    source = (
        AnthropicChunks(AnthropicStreamTranslator("m", include_usage=True, created=1))
        if claude
        else ConverseChunks(ConverseStreamTranslator("m", created=1))
    )
    chunks = 0
    for start in range(0, len(data), READ_BYTES):
        for message in decoder.feed(data[start : start + READ_BYTES]):
            chunks += len(source.feed(message))
    assert source.ended
    return chunks


def timed(fn: Callable[[], object], runs: int) -> dict[str, float]:
    samples: list[float] = []
    deadline = time.perf_counter() + TIME_LIMIT_S
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
        if time.perf_counter() > deadline:
            break
    samples.sort()
    return {
        "runs": len(samples),
        "p50_us": round(statistics.median(samples), 1),
        "p99_us": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    os.environ.update(
        AWS_ACCESS_KEY_ID="AKIDBENCH",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_SESSION_TOKEN="bench-token",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
    )
    signer = AwsSigner("us-east-1")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(signer.start())
    headers = {"content-type": "application/json", "accept": "application/json"}
    rows: dict[str, dict[str, float]] = {}
    for size in (2 * 1024, 64 * 1024, 512 * 1024):
        body = b'{"messages":[{"role":"user","content":[{"text":"' + b"x" * size + b'"}]}]}'
        rows[f"sign a {size // 1024} KB body"] = timed(
            lambda body=body: loop.run_until_complete(signer.sign(URL, body, headers)), args.runs
        )
    claude, converse = claude_stream(40), converse_stream(40)
    rows["decode + translate an InvokeModel stream (40 deltas)"] = timed(
        lambda: decode_and_translate(claude, True), args.runs
    )
    rows["decode + translate a Converse stream (40 deltas)"] = timed(
        lambda: decode_and_translate(converse, False), args.runs
    )
    loop.close()
    print("| measurement | runs | p50 | p99 |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['runs']} | {row['p50_us']} µs | {row['p99_us']} µs |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
