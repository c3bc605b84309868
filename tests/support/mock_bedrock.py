"""A mock Amazon Bedrock runtime at its real wire format, for `bedrock` route tests.

Paths as botocore's service model names them (`/model/{modelId}/invoke`, `/invoke-with-response-
stream`, `/converse`, `/converse-stream`, the id percent-encoded), answers in AWS event-stream
framing (frames encoded here with their prelude, typed headers and both CRCs, written one by one
and one of them split across two writes), errors as Bedrock sends them (`x-amzn-errortype`, a
`{"message"}` body; in-stream `:message-type: exception` frames). Every request's SigV4
signature is recomputed with botocore's own signer from what arrived (the same credentials, the
timestamp of its X-Amz-Date) and compared with its Authorization.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote

import orjson
from aiohttp import web
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials

ACCESS_KEY = "AKIDEXAMPLEBEDROCK01"
SECRET_KEY = "wJalrXUtnFEMI-secret-never-logged-EXAMPLEKEY"
SESSION_TOKEN = "FwoGZXIvYXdzE-session-token-never-logged"
REGION = "us-east-1"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_SESSION_TOKEN": SESSION_TOKEN,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
}
CACHE_READ = 2048
CACHE_WRITE = 256


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude (total and headers length, CRC), string headers
    (type 7), payload, message CRC."""
    encoded = b"".join(
        bytes([len(name)])
        + name.encode()
        + b"\x07"
        + struct.pack(">H", len(value))
        + value.encode()
        for name, value in headers.items()
    )
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    prelude += struct.pack(">I", binascii.crc32(prelude))
    message = prelude + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def event(kind: str, payload: dict) -> bytes:
    headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
    return frame(headers, orjson.dumps(payload))


def exception(kind: str, message: str) -> bytes:
    headers = {
        ":exception-type": kind,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return frame(headers, orjson.dumps({"message": message}))


def chunk(anthropic_event: dict) -> bytes:
    """An InvokeModel `chunk`: the base64 of one Anthropic stream event."""
    return event("chunk", {"bytes": base64.b64encode(orjson.dumps(anthropic_event)).decode()})


def verify_signature(request: web.Request, body: bytes) -> None:
    """Recompute the request's SigV4 signature with botocore and compare; AssertionError if
    it differs, names a header it does not sign, or lacks the session token."""
    authorization = request.headers["Authorization"]
    scheme, _, fields = authorization.partition(" ")
    assert scheme == "AWS4-HMAC-SHA256"
    parts = dict(item.strip().split("=", 1) for item in fields.split(","))
    signed = parts["SignedHeaders"].split(";")
    assert {"host", "x-amz-date", "x-amz-security-token", "content-type"} <= set(signed)
    assert request.headers["X-Amz-Security-Token"] == SESSION_TOKEN
    headers = {name: request.headers[name] for name in signed}
    url = f"http://{request.headers['Host']}{request.raw_path}"
    replay = AWSRequest(method=request.method, url=url, data=body, headers=headers)
    replay.context["timestamp"] = request.headers["X-Amz-Date"]
    credentials = ReadOnlyCredentials(ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)
    signer = SigV4Auth(credentials, "bedrock", REGION)
    canonical = signer.canonical_request(replay)
    signature = signer.signature(signer.string_to_sign(replay, canonical), replay)
    assert parts["Credential"] == signer.scope(replay)
    assert parts["SignedHeaders"] == signer.signed_headers(signer.headers_to_sign(replay))
    assert parts["Signature"] == signature, "the SigV4 signature does not verify"


@dataclass
class Script:
    """What the mock answers next."""

    http_errors: list[tuple[int, str, str]] = field(default_factory=list)  # status, type, message
    stream_exceptions: list[str] = field(default_factory=list)  # thrown before the first frame
    late_exception: str | None = None  # thrown after the first text delta, once `late_gate`
    late_gate: threading.Event | None = None  # is set (the client has seen that delta)
    retry_after: str | None = None


class MockBedrock:
    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[dict] = []  # raw_path, model_id, action, headers, body, verified
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        path = request.raw_path
        if request.method != "POST" or not path.startswith("/model/"):
            return web.Response(status=404)
        encoded_id, _, action = path[len("/model/") :].rpartition("/")
        verified = True
        try:
            verify_signature(request, raw)
        except (AssertionError, KeyError, ValueError):
            verified = False
        body = orjson.loads(raw) if raw else {}
        self.requests.append(
            {
                "raw_path": path,
                "model_id": unquote(encoded_id),
                "action": action,
                "headers": dict(request.headers),
                "body": body,
                "verified": verified,
            }
        )
        if not verified:
            return self.error(403, "InvalidSignatureException", "The signature does not match")
        if self.script.http_errors:
            return self.error(*self.script.http_errors.pop(0))
        claude = "anthropic." in unquote(encoded_id)
        tools = bool(body.get("tools") or body.get("toolConfig"))
        if action == "invoke":
            return web.json_response(claude_message(tools))
        if action == "converse":
            return web.json_response(converse_answer(tools))
        frames = claude_frames(tools) if claude else converse_frames(tools)
        return await self.stream(request, frames)

    def error(self, status: int, kind: str, message: str) -> web.Response:
        headers = {
            "x-amzn-errortype": f"{kind}:http://internal.amazon.com/coral/com.amazon.bedrock/",
            "x-amzn-requestid": "req-bedrock-error",
        }
        if self.script.retry_after:
            headers["retry-after"] = self.script.retry_after
        return web.json_response({"message": message}, status=status, headers=headers)

    async def stream(self, request: web.Request, frames: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "content-type": "application/vnd.amazon.eventstream",
                "x-amzn-requestid": "req-bedrock-1",
            }
        )
        await resp.prepare(request)
        if self.script.stream_exceptions:
            kind = self.script.stream_exceptions.pop(0)
            await resp.write(exception(kind, "Too many requests, please wait before trying again."))
            await resp.write_eof()
            return resp
        late = self.script.late_exception
        for index, data in enumerate(frames):
            if index == 1:  # one frame in two writes: the decoder must wait for the rest
                await resp.write(data[:7])
                await resp.write(data[7:])
            else:
                await resp.write(data)
            if late and index == 2:
                gate = self.script.late_gate
                if gate is not None:
                    await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
                await resp.write(exception(late, "The model stream failed."))
                break
        await resp.write_eof()
        return resp


def claude_usage() -> dict:
    return {
        "input_tokens": 12,
        "cache_read_input_tokens": CACHE_READ,
        "cache_creation_input_tokens": CACHE_WRITE,
        "output_tokens": 1,
    }


def claude_frames(tools: bool) -> list[bytes]:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_bdrk_1",
            "type": "message",
            "role": "assistant",
            "model": "claude",
            "content": [],
            "usage": claude_usage(),
        },
    }
    frames = [chunk(start)]
    if tools:
        frames += [
            chunk(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {},
                    },
                }
            ),
            chunk(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": '{"city": '},
                }
            ),
            chunk(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'},
                }
            ),
        ]
        reason = "tool_use"
    else:
        frames += [
            chunk(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            ),
            chunk(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "Hello"},
                }
            ),
            chunk(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": " from Bedrock"},
                }
            ),
        ]
        reason = "end_turn"
    metrics = {
        "inputTokenCount": 12,
        "outputTokenCount": 5,
        "invocationLatency": 100,
        "firstByteLatency": 40,
    }
    return [
        *frames,
        chunk({"type": "content_block_stop", "index": 0}),
        chunk(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason},
                "usage": {"output_tokens": 5},
            }
        ),
        chunk({"type": "message_stop", "amazon-bedrock-invocationMetrics": metrics}),
    ]


def claude_message(tools: bool) -> dict:
    content = (
        [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]
        if tools
        else [{"type": "text", "text": "Hello from Bedrock"}]
    )
    return {
        "id": "msg_bdrk_2",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": content,
        "stop_reason": "tool_use" if tools else "end_turn",
        "usage": {**claude_usage(), "output_tokens": 5},
    }


def converse_usage() -> dict:
    return {
        "inputTokens": 12,
        "outputTokens": 5,
        "totalTokens": 12 + 5 + CACHE_READ,
        "cacheReadInputTokens": CACHE_READ,
        "cacheWriteInputTokens": 0,
    }


def converse_frames(tools: bool) -> list[bytes]:
    frames = [event("messageStart", {"role": "assistant"})]
    if tools:
        frames += [
            event(
                "contentBlockStart",
                {
                    "contentBlockIndex": 0,
                    "start": {"toolUse": {"toolUseId": "tooluse_1", "name": "get_weather"}},
                },
            ),
            event(
                "contentBlockDelta",
                {"contentBlockIndex": 0, "delta": {"toolUse": {"input": '{"city": '}}},
            ),
            event(
                "contentBlockDelta",
                {"contentBlockIndex": 0, "delta": {"toolUse": {"input": '"Paris"}'}}},
            ),
        ]
    else:
        frames += [
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Hello"}}),
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": " from Nova"}}),
        ]
    return [
        *frames,
        event("contentBlockStop", {"contentBlockIndex": 0}),
        event("messageStop", {"stopReason": "tool_use" if tools else "end_turn"}),
        event("metadata", {"usage": converse_usage(), "metrics": {"latencyMs": 120}}),
    ]


def converse_answer(tools: bool) -> dict:
    content = (
        [{"toolUse": {"toolUseId": "tooluse_1", "name": "get_weather", "input": {"city": "Paris"}}}]
        if tools
        else [{"text": "Hello from Nova"}]
    )
    return {
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": "tool_use" if tools else "end_turn",
        "usage": converse_usage(),
        "metrics": {"latencyMs": 120},
    }
