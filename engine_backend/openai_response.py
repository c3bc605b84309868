"""The OpenAI shapes the engine answers in: one builder for chat and legacy completions,
streamed and whole, and one error body.

Chat and legacy completions differ only in names (the id's prefix, the `object` field)
and in where the text goes (a `delta` or `message` for chat, `text` for completions), so
one builder per response holds those differences and every dict is made in one place.
`usage.prompt_tokens_details.cached_tokens` carries the engine's prefix-cache hits.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engine_backend.engine_thread import RequestOutput


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One OpenAI endpoint the engine serves, and the names its responses carry."""

    name: str  # "chat" | "completions", as the gateway names them
    prompt_param: str  # the request field a prompt error points at
    id_prefix: str
    whole_object: str
    chunk_object: str

    @property
    def is_chat(self) -> bool:
        return self is CHAT


CHAT = Endpoint("chat", "messages", "chatcmpl-", "chat.completion", "chat.completion.chunk")
COMPLETIONS = Endpoint("completions", "prompt", "cmpl-", "text_completion", "text_completion")
ENDPOINTS = {endpoint.name: endpoint for endpoint in (CHAT, COMPLETIONS)}


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """An error in OpenAI's shape, so SDKs raise their usual exception classes."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(last: RequestOutput | None, num_prompt_tokens: int) -> dict:
    completion = last.num_output_tokens if last else 0
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens if last else 0},
    }


def finish_reason(last: RequestOutput | None) -> str:
    """OpenAI's reason; the engine's own "abort" (it gave up on the sequence) has no
    OpenAI counterpart and reads as "stop"."""
    reason = last.finish_reason if last else None
    return reason if reason in ("stop", "length") else "stop"


class ResponseBuilder:
    """The dicts of one response: one id and creation time for all its chunks."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        num_prompt_tokens: int,
        *,
        include_usage: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = include_usage
        self._head = {
            "id": f"{endpoint.id_prefix}{uuid.uuid4().hex}",
            "object": endpoint.chunk_object,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }
        if include_usage:  # OpenAI sends "usage": null on every chunk before the last
            self._head["usage"] = None

    def opening_chunks(self) -> list[dict]:
        """What a stream sends before any text: chat announces the assistant's role."""
        if self.endpoint.is_chat:
            role = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
            return [self._chunk(choice)]
        return []

    def text_chunk(self, text: str) -> dict:
        return self._chunk(self._choice(text))

    def finish_chunk(self, last: RequestOutput) -> dict:
        return self._chunk(self._choice(None, finish_reason(last)))

    def usage_chunk(self, last: RequestOutput | None) -> dict:
        return {**self._head, "choices": [], "usage": usage(last, self.num_prompt_tokens)}

    def whole(self, text: str, last: RequestOutput | None) -> dict:
        """The non-streamed response."""
        if self.endpoint.is_chat:
            output: dict = {"message": {"role": "assistant", "content": text, "refusal": None}}
        else:
            output = {"text": text}
        choice = {"index": 0, **output, "logprobs": None, "finish_reason": finish_reason(last)}
        return {
            **self._head,
            "object": self.endpoint.whole_object,
            "choices": [choice],
            "usage": usage(last, self.num_prompt_tokens),
        }

    def _choice(self, text: str | None, reason: str | None = None) -> dict:
        """A chunk's choice: new text, or (text None) the end with its finish reason."""
        if self.endpoint.is_chat:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def _chunk(self, choice: dict) -> dict:
        return {**self._head, "choices": [choice]}
