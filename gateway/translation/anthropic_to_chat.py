"""Anthropic Messages -> OpenAI: whole responses, SSE events and error bodies.

The client holds an OpenAI SDK, so whatever Anthropic answers must come back in OpenAI's shapes:
a `chat.completion`, a stream of `chat.completion.chunk`s, or an `{"error": {...}}` body. The
stream translator is fed one event at a time and returns the chunks for that event at once, so
the gateway never holds back a token.

Usage: Anthropic counts fresh input (`input_tokens`), cache reads and cache writes separately;
OpenAI's `prompt_tokens` is their sum, with the reads in `prompt_tokens_details.cached_tokens`.
The write count has no OpenAI field, so it is kept visible in two places (see `openai_usage`).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.errors import error_body, upstream_error_parts
from gateway.telemetry.usage import from_anthropic
from gateway.translation.chat_answer import obj
from gateway.translation.chat_writer import (
    assistant_message,
    chunk,
    chunk_head,
    completion,
    completion_choice,
    function_call,
    new_chat_id,
)

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}

_ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class AnthropicStreamError(RuntimeError):
    """An `error` event inside an Anthropic stream (e.g. `overloaded_error` mid-answer)."""

    def __init__(self, message: str, error_type: str = "api_error"):
        super().__init__(message)
        self.message = message
        self.type = error_type

    def to_openai(self) -> dict:
        """The OpenAI error body to send in-stream."""
        return error_body(self.message, self.type)


def finish_reason(stop_reason: str | None) -> str | None:
    """Anthropic `stop_reason` -> OpenAI `finish_reason` (unknown reasons read as "stop")."""
    if stop_reason is None:
        return None
    return FINISH_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def openai_usage(usage: Any) -> dict:
    """Anthropic usage -> OpenAI usage (``gateway.telemetry.usage``, the one table)."""
    return from_anthropic(usage)


def to_openai_response(
    resp: dict, model: str, *, created: int | None = None, answer_tool: str | None = None
) -> dict:
    """Translate a non-streaming Anthropic message into an OpenAI `chat.completion`.

    `answer_tool`: the tool that carries a structured answer (`anthropic_structured`); its
    first call's input is the message's content, as JSON text, and not a tool call."""
    texts: list[str] = []
    thoughts: list[str] = []
    tool_calls: list[dict] = []
    answered = False
    content = resp.get("content")
    for block in content if isinstance(content, list) else ():
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            thoughts.append(block.get("thinking", ""))
        elif kind == "tool_use" and answer_tool is not None and block.get("name") == answer_tool:
            if not answered:
                answered = True
                texts.append(orjson.dumps(obj(block.get("input"))).decode())
        elif kind == "tool_use":
            tool_calls.append(function_call(block["id"], block["name"], block.get("input")))
    reason = _answered_reason(
        finish_reason(resp.get("stop_reason")) or "stop", answered, bool(tool_calls)
    )
    return completion(
        resp.get("id") or new_chat_id(),
        model,
        int(time.time()) if created is None else created,
        [completion_choice(assistant_message(texts, thoughts, tool_calls), reason)],
        openai_usage(resp.get("usage")),
    )


def _answered_reason(reason: str, answered: bool, tool_calls: bool) -> str:
    """A structured answer ends like OpenAI's, `stop`, though Anthropic stopped for a tool."""
    return "stop" if answered and not tool_calls and reason == "tool_calls" else reason


class AnthropicStreamTranslator:
    """Turns Anthropic SSE events into OpenAI `chat.completion.chunk` dicts, one event at a time.

    Only `tool_use` blocks become OpenAI tool calls; their OpenAI `index` counts tool blocks
    alone, while Anthropic's block index counts every block, so the translator keeps the map.
    The `answer_tool`'s block (a structured answer, `anthropic_structured`) is content instead:
    each `input_json_delta` of it a content delta.
    """

    def __init__(
        self,
        model: str,
        *,
        include_usage: bool,
        created: int | None = None,
        request_id: str | None = None,
        answer_tool: str | None = None,
    ):
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created
        self.id = request_id
        self.usage: dict | None = None
        self._anthropic_usage: dict = {}
        self._tool_index_by_block: dict[int, int] = {}
        self._answer_tool = answer_tool
        self._answer_block: int | None = None
        self._answer_sent = False

    def feed(self, event: str, data: dict) -> list[dict]:
        """Translate one event (its SSE name and parsed data) into zero or more chunks."""
        kind = event if event and event != "message" else data.get("type", "")
        if kind == "content_block_delta":
            return self._on_block_delta(data)
        if kind == "content_block_start":
            return self._on_block_start(data)
        if kind == "message_start":
            return self._on_message_start(obj(data.get("message")))
        if kind == "message_delta":
            return self._on_message_delta(data)
        if kind == "content_block_stop":
            return self._on_block_stop(data)
        if kind == "message_stop":
            if self.include_usage and self.usage is not None:
                return [{**self._chunk_head(), "choices": [], "usage": self.usage}]
            return []
        if kind == "error":
            error = obj(data.get("error"))
            raise AnthropicStreamError(
                str(error.get("message") or "upstream stream error"),
                str(error.get("type") or "api_error"),
            )
        return []  # ping, and event types added after this was written

    def _on_message_start(self, message: dict) -> list[dict]:
        if self.id is None:
            self.id = message.get("id") or new_chat_id()
        self._update_usage(obj(message.get("usage")))
        return [self._chunk({"role": "assistant", "content": ""})]

    def _on_block_start(self, data: dict) -> list[dict]:
        block = obj(data.get("content_block"))
        kind = block.get("type")
        if kind == "tool_use" and self._is_answer(block):
            if self._answer_block is not None:
                return []  # a second answer: only the first is the content, as in whole ones
            self._answer_block = data.get("index", 0)
            initial_input = block.get("input")
            if not initial_input:
                return []
            self._answer_sent = True
            return [self._chunk({"content": orjson.dumps(initial_input).decode()})]
        if kind == "tool_use":
            tool_index = len(self._tool_index_by_block)
            self._tool_index_by_block[data.get("index", 0)] = tool_index
            initial_input = block.get("input")
            arguments = orjson.dumps(initial_input).decode() if initial_input else ""
            call = {
                "index": tool_index,
                "id": block.get("id"),
                "type": "function",
                "function": {"name": block.get("name"), "arguments": arguments},
            }
            return [self._chunk({"tool_calls": [call]})]
        if kind == "text" and block.get("text"):
            return [self._chunk({"content": block["text"]})]
        if kind == "thinking" and block.get("thinking"):
            return [self._chunk({"reasoning_content": block["thinking"]})]
        return []

    def _on_block_delta(self, data: dict) -> list[dict]:
        delta = obj(data.get("delta"))
        kind = delta.get("type")
        if kind == "text_delta":
            text = delta.get("text")
            return [self._chunk({"content": text})] if text else []
        if kind == "input_json_delta":
            fragment = delta.get("partial_json")
            if self._answer_block is not None and data.get("index", 0) == self._answer_block:
                if not fragment or not isinstance(fragment, str):
                    return []
                self._answer_sent = True
                return [self._chunk({"content": fragment})]
            tool_index = self._tool_index_by_block.get(data.get("index", 0))
            if not fragment or tool_index is None:
                return []
            call = {"index": tool_index, "function": {"arguments": fragment}}
            return [self._chunk({"tool_calls": [call]})]
        if kind == "thinking_delta":
            thinking = delta.get("thinking")
            return [self._chunk({"reasoning_content": thinking})] if thinking else []
        return []  # signature_delta, citations_delta: nothing OpenAI clients can use

    def _on_block_stop(self, data: dict) -> list[dict]:
        """The end of the answer block: an answer with no input at all is the empty object."""
        if self._answer_block is None or data.get("index", 0) != self._answer_block:
            return []
        if self._answer_sent:
            return []
        self._answer_sent = True
        return [self._chunk({"content": "{}"})]

    def _on_message_delta(self, data: dict) -> list[dict]:
        self._update_usage(obj(data.get("usage")))
        reason = finish_reason(obj(data.get("delta")).get("stop_reason"))
        if reason is None:
            return []
        answered = self._answer_block is not None
        reason = _answered_reason(reason, answered, bool(self._tool_index_by_block))
        return [self._chunk({}, finish_reason=reason)]

    def _is_answer(self, block: dict) -> bool:
        return self._answer_tool is not None and block.get("name") == self._answer_tool

    def _update_usage(self, usage: dict) -> None:
        """Anthropic's counts are cumulative; later events may repeat or raise earlier ones."""
        for name, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                self._anthropic_usage[name] = value
        self.usage = openai_usage(self._anthropic_usage)

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return chunk(self._chunk_head(), delta, finish_reason)

    def _chunk_head(self) -> dict:
        if self.id is None:
            self.id = new_chat_id()
        return chunk_head(self.id, self.model, self.created)


def error_to_openai(status: int, body: bytes) -> dict:
    """An Anthropic error response body -> OpenAI `{"error": {...}}`, keeping message and type.

    Other bodies (a proxy's text or HTML page, FastAPI's `detail`) keep their message, bounded
    (`gateway.errors.upstream_error_parts`)."""
    parts = upstream_error_parts(status, body, _ERROR_TYPE_BY_STATUS.get(status, "api_error"))
    return error_body(parts["message"], parts["type"])
