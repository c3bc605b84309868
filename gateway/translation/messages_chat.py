"""Anthropic Messages requests -> OpenAI chat, and chat answers -> Messages.

Used by `POST /v1/messages` when the model is served by an `openai` or `local` route: the client
holds an Anthropic SDK, the upstream speaks chat completions. Requests whose meaning chat cannot
carry (server tools, documents, ...) fail with a `TranslationError` (a 400) instead of being
answered as something else; what is merely lost (thinking blocks, cache markers) is dropped and
named in `Translated.notes` so the gateway can say so in a response header. Fields with no chat
counterpart that change little (`top_k`, `metadata`, `service_tier`, `container`, ...) are
dropped without a note.

The chat answer (untrusted) is read by `chat_answer`; this module writes it as an Anthropic
`message`, or as Messages stream events that go out with the chunk that made them.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.translation.chat_answer import (
    ChatStreamReader,
    obj,
    read_completion,
    read_usage,
    sse_event,
)
from gateway.translation.chat_to_anthropic import TranslationError


@dataclass(frozen=True)
class Translated:
    """A translated chat request, and what the translation had to drop (for a header)."""

    body: dict
    notes: tuple[str, ...]


STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# Anthropic's error type for each HTTP status; the SDK picks its exception by status, the type
# is what a client logs.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_THINKING_NOTE = "thinking blocks dropped"


def anthropic_error_type(status: int) -> str:
    """The Anthropic error `type` for an HTTP status."""
    return ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )


# --- request ----------------------------------------------------------------------------------


def messages_request_to_chat(body: dict) -> Translated:
    """Translate an Anthropic Messages request body into an OpenAI chat request body."""
    if not isinstance(body, dict):
        raise TranslationError("the request body must be a JSON object")
    notes: list[str] = []
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TranslationError("'messages' must be a non-empty list", "messages")
    chat_messages = _system_messages(body.get("system"))
    for i, message in enumerate(messages):
        chat_messages.extend(_translate_message(message, f"messages.{i}", notes))
    out["messages"] = chat_messages

    copy_max_tokens(body, "max_tokens", out)
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise TranslationError("'stop_sequences' must be a list of strings", "stop_sequences")
        if stop:
            out["stop"] = list(stop)
    copy_sampling(body, out)

    tools = _translate_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        _translate_tool_choice(body.get("tool_choice"), out)
    response_format = _response_format(body)
    if response_format is not None:
        out["response_format"] = response_format

    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        _note(notes, "thinking dropped")
    return finish_request(body, out, notes)


# The request steps Messages and Responses share (the Responses translator imports them).


def copy_max_tokens(body: dict, name: str, out: dict) -> None:
    """Chat's `max_tokens` from the client API's output limit `name` (a positive integer)."""
    max_tokens = body.get(name)
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise TranslationError(f"'{name}' must be a positive integer", name)
        out["max_tokens"] = max_tokens


def copy_sampling(body: dict, out: dict) -> None:
    """`temperature` and `top_p`, which mean the same in every API (numbers; a bool is not)."""
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TranslationError(f"'{name}' must be a number", name)
            out[name] = value


def tool_list(tools: Any) -> list:
    """The client's `tools` as a list (empty when absent); anything else fails the request."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise TranslationError("'tools' must be a list", "tools")
    return tools


def finish_request(body: dict, out: dict, notes: list[str]) -> Translated:
    """The translated request; a stream asks chat for the usage chunk both APIs end with."""
    if body.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return Translated(out, tuple(notes))


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _system_messages(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise TranslationError("'system' must be a string or a list of text blocks", "system")
    texts = []
    for k, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise TranslationError("'system' may hold text blocks only", f"system.{k}")
        texts.append(_text_of(block, f"system.{k}"))
    text = "\n\n".join(t for t in texts if t)
    return [{"role": "system", "content": text}] if text else []


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise TranslationError("a text block needs a string 'text'", f"{where}.text")
    return text


def _translate_message(message: Any, where: str, notes: list[str]) -> list[dict]:
    if not isinstance(message, dict):
        raise TranslationError("each message must be an object", where)
    role = message.get("role")
    content = message.get("content")
    if role not in ("user", "assistant"):
        raise TranslationError("'role' must be 'user' or 'assistant'", f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise TranslationError("'content' must be a string or a list of blocks", f"{where}.content")
    if role == "assistant":
        return _assistant_message(content, f"{where}.content", notes)
    return _user_messages(content, f"{where}.content", notes)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise TranslationError("each content block must be an object with a 'type'", where)
    return block["type"]


def _blocks_of(
    blocks: list, where: str, notes: list[str], kinds: tuple[str, ...]
) -> Iterator[tuple[str, dict, str]]:
    """Each block of a turn as (type, block, where), in order; thinking blocks are dropped with
    a note, and the first block of a type not in `kinds` fails the request."""
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind in ("thinking", "redacted_thinking"):
            _note(notes, _THINKING_NOTE)
        elif kind in kinds:
            yield kind, block, at
        else:
            raise TranslationError(
                f"content block type {kind!r} is not supported for this model's route",
                f"{at}.type",
            )


def _user_messages(blocks: list, where: str, notes: list[str]) -> list[dict]:
    """A user turn -> its tool results as `tool` messages, then the rest as one user message
    (chat wants a tool result right after the assistant message that made the call)."""
    tool_messages: list[dict] = []
    parts: list[dict] = []
    for kind, block, at in _blocks_of(blocks, where, notes, ("text", "image", "tool_result")):
        if kind == "tool_result":
            tool_messages.append(_tool_message(block, at))
        elif kind == "image":
            parts.append(_image_part(block.get("source"), f"{at}.source"))
        else:
            parts.append({"type": "text", "text": _text_of(block, at)})
    out = tool_messages
    if parts:
        out.append({"role": "user", "content": parts})
    elif not tool_messages:
        out.append({"role": "user", "content": ""})
    return out


def _image_part(source: Any, where: str) -> dict:
    source = obj(source)
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise TranslationError("a base64 image needs 'media_type' and 'data'", where)
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise TranslationError("a url image needs a string 'url'", f"{where}.url")
    else:
        raise TranslationError("image 'source.type' must be 'base64' or 'url'", f"{where}.type")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_message(block: dict, where: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise TranslationError("a tool_result needs a 'tool_use_id'", f"{where}.tool_use_id")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, inner in enumerate(content):
            at = f"{where}.content.{k}"
            kind = _block_type(inner, at)
            if kind != "text":
                raise TranslationError(
                    f"tool_result content block type {kind!r} is not supported for this "
                    "model's route; only text",
                    f"{at}.type",
                )
            texts.append(_text_of(inner, at))
        text = "\n\n".join(texts)
    else:
        raise TranslationError(
            "tool_result 'content' must be a string or a list of blocks", f"{where}.content"
        )
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _assistant_message(blocks: list, where: str, notes: list[str]) -> list[dict]:
    texts: list[str] = []
    tool_calls: list[dict] = []
    for kind, block, at in _blocks_of(blocks, where, notes, ("text", "tool_use")):
        if kind == "tool_use":
            tool_calls.append(_tool_call(block, at))
        else:
            texts.append(_text_of(block, at))
    text = "".join(texts)
    if not tool_calls:
        return [{"role": "assistant", "content": text}]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    message["tool_calls"] = tool_calls
    return [message]


def _tool_call(block: dict, where: str) -> dict:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError("a tool_use block needs an 'id'", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise TranslationError("a tool_use block needs a 'name'", f"{where}.name")
    tool_input = block.get("input")
    if tool_input is None:
        tool_input = {}
    if not isinstance(tool_input, dict):
        raise TranslationError("a tool_use 'input' must be an object", f"{where}.input")
    arguments = orjson.dumps(tool_input).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _translate_tools(tools: Any) -> list[dict]:
    out = []
    for k, tool in enumerate(tool_list(tools)):
        where = f"tools.{k}"
        if not isinstance(tool, dict):
            raise TranslationError("each tool must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise TranslationError(
                f"tool type {kind!r} is an Anthropic server tool, only served by Anthropic routes",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("a tool needs a 'name'", f"{where}.name")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if isinstance(description, str) and description:
            function["description"] = description
        schema = tool.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise TranslationError("a tool's 'input_schema' must be an object", where)
        function["parameters"] = schema or {"type": "object", "properties": {}}
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _translate_tool_choice(choice: Any, out: dict) -> None:
    """Set `tool_choice` / `parallel_tool_calls` on `out` (only called when there are tools:
    chat rejects both without them)."""
    if choice is None:
        return
    choice = obj(choice)
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("tool_choice of type 'tool' needs a 'name'", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise TranslationError(
            "tool_choice type must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type"
        )
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def _response_format(body: dict) -> dict | None:
    """Anthropic structured outputs (`output_config.format`, or the beta `output_format`)
    -> chat `response_format`; dropping them would answer free text where JSON was asked."""
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        fmt = body.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise TranslationError("output format must be of type 'json_schema'", "output_config")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise TranslationError("a json_schema output format needs a 'schema'", "output_config")
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


# --- whole responses --------------------------------------------------------------------------


def chat_completion_to_message(completion: dict, model: str) -> dict:
    """Translate a `chat.completion` into an Anthropic `message` named `model`."""
    answer = read_completion(completion)
    content: list[dict] = []
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    for call in answer.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.call_id or _tool_use_id(call.position),
                "name": call.name,
                "input": _arguments_object(call.arguments),
            }
        )
    return {
        "id": "msg_" + answer.stem,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(answer.finish_reason),
        "stop_sequence": None,
        "usage": messages_usage(answer.usage),
    }


def stop_reason(finish_reason: Any) -> str:
    """Chat `finish_reason` -> Anthropic `stop_reason` (anything unknown reads as end_turn)."""
    if not isinstance(finish_reason, str):
        return "end_turn"
    return STOP_REASONS.get(finish_reason, "end_turn")


def messages_usage(usage: Any) -> dict:
    """Chat usage -> Anthropic usage. Chat's `prompt_tokens` counts cache reads (and, from the
    gateway's own Anthropic translation, cache writes) too; Anthropic counts them apart."""
    counts = read_usage(usage)
    written = min(counts.cache_write, counts.prompt - counts.cached)
    return {
        "input_tokens": counts.prompt - counts.cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": counts.cached,
        "output_tokens": counts.completion,
    }


def _arguments_object(arguments: Any) -> dict:
    if not isinstance(arguments, str):
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_use_id(k: int) -> str:
    return f"toolu_{secrets.token_hex(8)}_{k}"


# --- streams ----------------------------------------------------------------------------------


class ChatToMessagesStream(ChatStreamReader):
    """Turns `chat.completion.chunk` dicts into Anthropic SSE events, one chunk at a time.

    Anthropic ends a message with `message_delta` (stop reason and usage) then `message_stop`;
    chat sends `finish_reason` first and usage in a later chunk, so the end is held until the
    usage arrives or `finish()` is called. Content is never held.
    """

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def on_start(self, created: Any) -> list[bytes]:
        message: dict[str, Any] = {
            "id": "msg_" + self._stem,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def on_text_start(self, part: int) -> list[bytes]:
        return [self._block_start(part, {"type": "text", "text": ""})]

    def on_text(self, part: int, text: str) -> list[bytes]:
        return [self._delta(part, {"type": "text_delta", "text": text})]

    def on_tool_call_start(
        self, part: int, tool_index: int, call_id: str | None, name: str
    ) -> list[bytes]:
        content_block = {
            "type": "tool_use",
            "id": call_id or _tool_use_id(tool_index),
            "name": name,
            "input": {},
        }
        return [self._block_start(part, content_block)]

    def on_tool_call_fragment(self, part: int, fragment: str) -> list[bytes]:
        return [self._delta(part, {"type": "input_json_delta", "partial_json": fragment})]

    def on_close(self, part: int) -> list[bytes]:
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": part})]

    def on_end(self) -> list[bytes]:
        delta = {"stop_reason": stop_reason(self._finish_reason), "stop_sequence": None}
        data = {"type": "message_delta", "delta": delta, "usage": messages_usage(self._usage)}
        return [
            sse_event("message_delta", data),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def _block_start(self, part: int, content_block: dict) -> bytes:
        data = {"type": "content_block_start", "index": part, "content_block": content_block}
        return sse_event("content_block_start", data)

    def _delta(self, part: int, delta: dict) -> bytes:
        data = {"type": "content_block_delta", "index": part, "delta": delta}
        return sse_event("content_block_delta", data)


# --- errors -----------------------------------------------------------------------------------


def chat_error_to_messages(status: int, error: dict) -> dict:
    """An OpenAI error body (`{"error": {...}}`, untrusted) -> an Anthropic error body."""
    inner = error.get("error") if isinstance(error, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else inner
    if not isinstance(message, str) or not message:
        message = f"upstream returned HTTP {status}"
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
