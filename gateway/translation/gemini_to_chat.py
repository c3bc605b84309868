"""Gemini `generateContent` answers -> OpenAI: whole responses, stream chunks, error bodies.

Gemini streams (`streamGenerateContent?alt=sse`) as a series of whole `GenerateContentResponse`
objects, each holding the next piece of every candidate; a function call arrives whole in one
part, never in fragments, and has no id of its own on the Gemini API, so the translator gives it
one (carrying the call's thought signature, see `chat_to_gemini.SIGNATURE_SEPARATOR`). The
stream has no end event: it ends when the connection does, after the chunk with a
`finishReason`.

Usage: `promptTokenCount` already includes `cachedContentTokenCount` (implicit or explicit cache
hits), which becomes OpenAI's `prompt_tokens_details.cached_tokens`; thinking tokens
(`thoughtsTokenCount`) count as completion tokens, as OpenAI counts reasoning. Gemini's own
`usageMetadata` is kept beside them, as sent.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import orjson

from gateway.errors import error_body
from gateway.translation.chat_answer import obj
from gateway.translation.chat_to_gemini import SIGNATURE_SEPARATOR
from gateway.translation.chat_writer import (
    as_list,
    assistant_message,
    chunk,
    chunk_head,
    completion,
    completion_choice,
    count,
    function_call,
)

FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "LANGUAGE": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "MODEL_ARMOR": "content_filter",
}

# Google's canonical error statuses -> (HTTP status when the answer's own is unusable, OpenAI
# error type). RESOURCE_EXHAUSTED is Google's throttling.
ERROR_STATUSES = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "ABORTED": (409, "api_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "api_error"),
    "INTERNAL": (500, "api_error"),
    "UNKNOWN": (500, "api_error"),
    "NOT_IMPLEMENTED": (501, "api_error"),
    "UNAVAILABLE": (503, "api_error"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
_RETRY_DELAY = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,9})?)s")
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"


def finish_reason(reason: Any, called: bool) -> str | None:
    """Gemini `finishReason` -> OpenAI `finish_reason`; a candidate that called a function
    finishes with `tool_calls` (Gemini says STOP)."""
    if not isinstance(reason, str) or reason == "FINISH_REASON_UNSPECIFIED":
        return None
    mapped = FINISH_REASONS.get(reason, "stop")
    return "tool_calls" if called and mapped == "stop" else mapped


def openai_usage(metadata: Any) -> dict:
    """Gemini `usageMetadata` -> OpenAI usage, the original kept under `usageMetadata`. A count
    that is not a non-negative integer reads as 0: a bad field loses only itself."""
    meta = obj(metadata)
    prompt = count(meta.get("promptTokenCount")) + count(meta.get("toolUsePromptTokenCount"))
    thoughts = count(meta.get("thoughtsTokenCount"))
    output = count(meta.get("candidatesTokenCount")) + thoughts
    total = count(meta.get("totalTokenCount")) or prompt + output
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": count(meta.get("cachedContentTokenCount"))},
        "completion_tokens_details": {"reasoning_tokens": thoughts},
        "usageMetadata": meta,
    }


def openai_logprobs(candidate: dict) -> dict | None:
    """A candidate's `logprobsResult` (asked for with `responseLogprobs`) as OpenAI's
    `logprobs.content`: the chosen token per step, with that step's top candidates."""
    result = candidate.get("logprobsResult")
    if not isinstance(result, dict):
        return None
    tops = as_list(result.get("topCandidates"))
    content = []
    for step, chosen in enumerate(as_list(result.get("chosenCandidates"))):
        chosen = obj(chosen)
        top = obj(tops[step]).get("candidates") if step < len(tops) else None
        content.append(
            {
                **_token_logprob(chosen),
                "top_logprobs": [_token_logprob(obj(c)) for c in as_list(top)],
            }
        )
    return {"content": content, "refusal": None}


def _token_logprob(entry: dict) -> dict:
    token = entry.get("token")
    logprob = entry.get("logProbability")
    return {
        "token": token if isinstance(token, str) else "",
        "logprob": float(logprob) if isinstance(logprob, int | float) else 0.0,
        "bytes": None,
    }


def new_call_id(part: dict) -> str:
    """An OpenAI tool call id for a Gemini function call part: Gemini's own id when it sent
    one (Vertex does), and the part's thought signature after the separator."""
    call = obj(part.get("functionCall"))
    own = call.get("id")
    call_id = own if isinstance(own, str) and own else "call_" + secrets.token_hex(12)
    signature = part.get("thoughtSignature")
    if isinstance(signature, str) and signature:
        call_id += SIGNATURE_SEPARATOR + signature
    return call_id


def tool_call(part: dict, index: int | None = None) -> dict:
    call = obj(part.get("functionCall"))
    return function_call(new_call_id(part), str(call.get("name") or ""), call.get("args"), index)


def to_openai_response(resp: dict, model: str, *, request_id: str, created: int) -> dict:
    """A whole `GenerateContentResponse` -> an OpenAI `chat.completion`."""
    choices = []
    for position, candidate in enumerate(as_list(resp.get("candidates"))):
        candidate = obj(candidate)
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict] = []
        for part in as_list(obj(candidate.get("content")).get("parts")):
            part = obj(part)
            if "functionCall" in part:
                calls.append(tool_call(part))
            elif isinstance(part.get("text"), str):
                (thoughts if part.get("thought") else texts).append(part["text"])
        index = candidate.get("index")
        choices.append(
            completion_choice(
                assistant_message(texts, thoughts, calls),
                finish_reason(candidate.get("finishReason"), bool(calls)) or "stop",
                index if isinstance(index, int) else position,
                openai_logprobs(candidate),
            )
        )
    if not choices and obj(resp.get("promptFeedback")).get("blockReason"):
        message = {"role": "assistant", "content": None, "refusal": None}
        choices.append(completion_choice(message, "content_filter"))
    return completion(request_id, model, created, choices, openai_usage(resp.get("usageMetadata")))


class GeminiStreamTranslator:
    """`GenerateContentResponse` chunks -> OpenAI `chat.completion.chunk` dicts, one at a time.

    `finished` once every candidate seen has a finish reason; `usage` is the latest
    `usageMetadata` translated (Gemini repeats it, growing, on each chunk)."""

    def __init__(self, model: str, *, request_id: str, created: int | None = None) -> None:
        self.model = model
        self.id = request_id
        self.created = int(time.time()) if created is None else created
        self.usage: dict | None = None
        self.prompt_feedback: dict | None = None
        self._started: set[int] = set()
        self._calls: dict[int, int] = {}  # candidate index -> tool calls sent so far
        self._open: set[int] = set()  # candidates without a finish reason yet

    @property
    def finished(self) -> bool:
        return (bool(self._started) and not self._open) or self.prompt_feedback is not None

    def feed(self, data: dict) -> list[dict]:
        """Translate one streamed response into zero or more chunks."""
        chunks: list[dict] = []
        if "usageMetadata" in data:
            self.usage = openai_usage(data["usageMetadata"])
        candidates = as_list(data.get("candidates"))
        for position, candidate in enumerate(candidates):
            candidate = obj(candidate)
            index = candidate.get("index")
            index = index if isinstance(index, int) and 0 <= index < 128 else position
            if index not in self._started:
                self._started.add(index)
                self._open.add(index)
                chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
            parts = self._parts(index, obj(candidate.get("content")).get("parts"))
            logprobs = openai_logprobs(candidate)
            if logprobs is not None and parts:
                parts[-1]["choices"][0]["logprobs"] = logprobs
            chunks.extend(parts)
            reason = finish_reason(candidate.get("finishReason"), self._calls.get(index, 0) > 0)
            if reason is not None and index in self._open:
                self._open.discard(index)
                chunks.append(self._chunk(index, {}, reason))
        feedback = obj(data.get("promptFeedback"))
        if not candidates and feedback.get("blockReason"):
            self.prompt_feedback = feedback
            chunks.append(self._chunk(0, {"role": "assistant", "content": ""}))
            chunks.append(self._chunk(0, {}, "content_filter"))
        return chunks

    def _parts(self, index: int, parts: Any) -> list[dict]:
        chunks = []
        for part in as_list(parts):
            part = obj(part)
            if "functionCall" in part:
                position = self._calls.get(index, 0)
                self._calls[index] = position + 1
                chunks.append(self._chunk(index, {"tool_calls": [tool_call(part, position)]}))
            elif isinstance(part.get("text"), str) and part["text"]:
                key = "reasoning_content" if part.get("thought") else "content"
                chunks.append(self._chunk(index, {key: part["text"]}))
        return chunks

    def usage_chunk(self) -> dict | None:
        """The include_usage chunk (choices empty), once Gemini reported usage."""
        if self.usage is None:
            return None
        return {**self._head(), "choices": [], "usage": self.usage}

    def _chunk(self, index: int, delta: dict, finish: str | None = None) -> dict:
        return chunk(self._head(), delta, finish, index)

    def _head(self) -> dict:
        return chunk_head(self.id, self.model, self.created)


def google_error(body: bytes | None) -> dict | None:
    """Google's `{"error": {"code", "message", "status", "details"}}`, or None when `body` is
    not one (a proxy's page, an Anthropic error from a Vertex Claude model)."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, list) and len(parsed) == 1:  # Vertex may wrap a stream's error
        parsed = parsed[0]
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("status"), str):
        return error
    return None


def error_to_openai(status: int, body: bytes | None) -> tuple[int, dict, float | None]:
    """A Google error answer -> (HTTP status, OpenAI error body, seconds to wait or None).

    The HTTP status is Google's own when it is an error status, else the one its `status`
    implies; RetryInfo's `retryDelay` gives the wait of a RESOURCE_EXHAUSTED."""
    error = google_error(body)
    if error is None:
        excerpt = (body or b"")[:500].decode("utf-8", "replace").strip()
        return status, error_body(excerpt or f"upstream returned HTTP {status}", "api_error"), None
    name = error["status"]
    implied, kind = ERROR_STATUSES.get(name, (status, "api_error"))
    out_status = status if status >= 400 else implied
    message = str(error.get("message") or f"upstream returned {name}")
    retry_after = None
    for detail in as_list(error.get("details")):
        detail = obj(detail)
        if detail.get("@type") == RETRY_INFO_TYPE and isinstance(detail.get("retryDelay"), str):
            found = _RETRY_DELAY.fullmatch(detail["retryDelay"])
            retry_after = float(found.group(1)) if found else None
    return out_status, error_body(message, kind, code=name.lower()), retry_after
