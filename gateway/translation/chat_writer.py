"""Writing an OpenAI chat answer, whole or streamed, for the translators that read another
provider's answer (`anthropic_to_chat`, `converse_to_chat`, `gemini_to_chat`): the mirror of
`chat_answer`, which reads one.

An OpenAI client must see the same message, tool call and chunk whichever provider answered, so
the shapes are written in one place; each translator keeps only the reading of its provider's
answer.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson


def new_chat_id() -> str:
    """An id for an answer whose provider gave none of OpenAI's shape."""
    return "chatcmpl-" + secrets.token_hex(12)


def as_list(value: Any) -> list:
    """`value` if it is a JSON array, else an empty one (junk reads as absent)."""
    return value if isinstance(value, list) else []


def count(value: Any) -> int:
    """A provider's token count when it is a non-negative integer, else 0: a bad field loses
    only itself."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return 0


def function_call(call_id: Any, name: Any, arguments: Any, index: int | None = None) -> dict:
    """An OpenAI tool call; `arguments` is the provider's parsed input, sent as JSON text (an
    empty object when it gave none). `index` numbers the call within a streamed answer."""
    call: dict[str, Any] = {} if index is None else {"index": index}
    call["id"] = call_id
    call["type"] = "function"
    call["function"] = {"name": name, "arguments": orjson.dumps(arguments or {}).decode()}
    return call


def assistant_message(texts: list[str], thoughts: list[str], tool_calls: list[dict]) -> dict:
    """The answer's message: its text (null when it only calls tools, as OpenAI's is), its
    tool calls, and its reasoning in `reasoning_content` (DeepSeek's and vLLM's field)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not tool_calls else None,
        "refusal": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def completion_choice(
    message: dict, finish_reason: str | None, index: int = 0, logprobs: dict | None = None
) -> dict:
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def completion(chat_id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    """A whole `chat.completion`."""
    return {
        "id": chat_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chunk_head(chat_id: str, model: str, created: int) -> dict:
    """What every `chat.completion.chunk` of one answer starts with."""
    return {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}


def chunk(head: dict, delta: dict, finish_reason: str | None = None, index: int = 0) -> dict:
    """One choice's `chat.completion.chunk` (a new dict: `head` is only read)."""
    out = dict(head)
    out["choices"] = [
        {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    ]
    return out
