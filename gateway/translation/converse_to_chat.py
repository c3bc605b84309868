"""Bedrock Converse -> OpenAI: whole responses, stream events and usage.

A Converse stream is a sequence of events: `messageStart`, then per content block an optional
`contentBlockStart` (a tool call's id and name), `contentBlockDelta`s (text, a tool call's input
as JSON fragments, reasoning) and `contentBlockStop`, then `messageStop` (the stop reason) and
`metadata` (usage and latency), the last one. The translator is fed one event at a time and
returns the chat chunks for it at once.

Usage: like Anthropic's, Converse counts fresh input (`inputTokens`) apart from cache reads
(`cacheReadInputTokens`) and writes (`cacheWriteInputTokens`); OpenAI's `prompt_tokens` is
their sum, the reads in `prompt_tokens_details.cached_tokens`, and Bedrock's own fields stay
beside them.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.translation.chat_answer import obj
from gateway.translation.chat_writer import (
    assistant_message,
    chunk,
    chunk_head,
    completion,
    completion_choice,
    count,
    function_call,
    new_chat_id,
)

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
}
CONVERSE_USAGE_FIELDS = (
    "inputTokens",
    "outputTokens",
    "totalTokens",
    "cacheReadInputTokens",
    "cacheWriteInputTokens",
)


def finish_reason(stop_reason: Any) -> str:
    return STOP_REASONS.get(stop_reason, "stop") if isinstance(stop_reason, str) else "stop"


def converse_usage(usage: Any) -> dict:
    """Converse usage -> OpenAI usage, Bedrock's counts kept beside it. A count that is not a
    non-negative integer reads as 0: a bad field loses only itself."""
    usage = usage if isinstance(usage, dict) else {}
    fresh = count(usage.get("inputTokens"))
    cache_read = count(usage.get("cacheReadInputTokens"))
    cache_write = count(usage.get("cacheWriteInputTokens"))
    prompt = fresh + cache_read + cache_write
    output = count(usage.get("outputTokens"))
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cache_read, "cache_write_tokens": cache_write},
    }
    out.update((name, count(usage[name])) for name in CONVERSE_USAGE_FIELDS if name in usage)
    return out


def to_openai_response(resp: dict, model: str, *, created: int | None = None) -> dict:
    """A non-streaming Converse answer -> an OpenAI `chat.completion`."""
    output = obj(resp.get("output"))
    content = obj(output.get("message")).get("content")
    texts: list[str] = []
    thoughts: list[str] = []
    tool_calls: list[dict] = []
    for block in content if isinstance(content, list) else ():
        block = obj(block)
        if isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif "toolUse" in block:
            use = obj(block["toolUse"])
            tool_calls.append(function_call(use["toolUseId"], use["name"], use.get("input")))
        elif "reasoningContent" in block:
            text = obj(obj(block["reasoningContent"]).get("reasoningText")).get("text")
            if isinstance(text, str):
                thoughts.append(text)
    message = assistant_message(texts, thoughts, tool_calls)
    return completion(
        new_chat_id(),
        model,
        int(time.time()) if created is None else created,
        [completion_choice(message, finish_reason(resp.get("stopReason")))],
        converse_usage(resp.get("usage")),
    )


class ConverseStreamTranslator:
    """Converse stream events -> OpenAI `chat.completion.chunk` dicts, one event at a time.
    Tool calls are numbered among tool blocks alone (OpenAI's `index`), while Converse's
    `contentBlockIndex` counts every block, so the translator keeps the map."""

    def __init__(self, model: str, *, created: int | None = None, request_id: str | None = None):
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.id = request_id or new_chat_id()
        self.usage: dict | None = None
        self.stopped = False  # messageStop came: the answer is whole
        self._tool_by_block: dict[int, int] = {}

    def feed(self, event: str, data: dict) -> list[dict]:
        if event == "contentBlockDelta":
            return self._on_delta(data)
        if event == "messageStart":
            return [self._chunk({"role": "assistant", "content": ""})]
        if event == "contentBlockStart":
            return self._on_block_start(data)
        if event == "messageStop":
            self.stopped = True
            return [self._chunk({}, finish_reason(data.get("stopReason")))]
        if event == "metadata":
            self.usage = converse_usage(data.get("usage"))
            return [{**self._head(), "choices": [], "usage": self.usage}]
        return []  # contentBlockStop, and event types added after this was written

    def _on_block_start(self, data: dict) -> list[dict]:
        use = obj(obj(data.get("start")).get("toolUse"))
        if not use:
            return []
        index = len(self._tool_by_block)
        self._tool_by_block[_block_index(data)] = index
        call = {
            "index": index,
            "id": use.get("toolUseId"),
            "type": "function",
            "function": {"name": use.get("name"), "arguments": ""},
        }
        return [self._chunk({"tool_calls": [call]})]

    def _on_delta(self, data: dict) -> list[dict]:
        delta = obj(data.get("delta"))
        text = delta.get("text")
        if isinstance(text, str):
            return [self._chunk({"content": text})] if text else []
        if "toolUse" in delta:
            fragment = obj(delta["toolUse"]).get("input")
            index = self._tool_by_block.get(_block_index(data))
            if not isinstance(fragment, str) or not fragment or index is None:
                return []
            return [
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            ]
        thinking = obj(delta.get("reasoningContent")).get("text")
        if isinstance(thinking, str) and thinking:
            return [self._chunk({"reasoning_content": thinking})]
        return []  # a reasoning signature, citations: nothing an OpenAI client can use

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return chunk(self._head(), delta, finish_reason)

    def _head(self) -> dict:
        return chunk_head(self.id, self.model, self.created)


def _block_index(data: dict) -> int:
    index = data.get("contentBlockIndex")
    return index if isinstance(index, int) else 0
