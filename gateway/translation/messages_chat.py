"""Anthropic Messages requests -> OpenAI chat, and chat answers -> Messages.

Used by `POST /v1/messages` when the model is served by an `openai` or `local` route: the client
holds an Anthropic SDK, the upstream speaks chat completions. Requests whose meaning chat cannot
carry (server tools, documents, ...) fail with a `TranslationError` (a 400) instead of being
answered as something else; what is merely lost (thinking blocks, cache markers) is dropped and
named in `Translated.notes` so the gateway can say so in a response header. Fields with no chat
counterpart that change little (`top_k`, `metadata`, `service_tier`, `container`, ...) are
dropped without a note.

The chat answer is untrusted: a field of the wrong type loses only itself, never the answer.
The stream translator returns each event as soon as its chunk is fed, so no token waits.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.timing import token_count
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
_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


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

    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise TranslationError("'max_tokens' must be a positive integer", "max_tokens")
        out["max_tokens"] = max_tokens
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise TranslationError("'stop_sequences' must be a list of strings", "stop_sequences")
        if stop:
            out["stop"] = list(stop)
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TranslationError(f"'{name}' must be a number", name)
            out[name] = value

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


def _unsupported(kind: str, where: str) -> TranslationError:
    return TranslationError(
        f"content block type {kind!r} is not supported for this model's route", f"{where}.type"
    )


def _user_messages(blocks: list, where: str, notes: list[str]) -> list[dict]:
    """A user turn -> its tool results as `tool` messages, then the rest as one user message
    (chat wants a tool result right after the assistant message that made the call)."""
    tool_messages: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image_part(block.get("source"), f"{at}.source"))
        elif kind == "tool_result":
            tool_messages.append(_tool_message(block, at))
        elif kind in ("thinking", "redacted_thinking"):
            _note(notes, _THINKING_NOTE)
        else:
            raise _unsupported(kind, at)
    out = tool_messages
    if parts:
        out.append({"role": "user", "content": parts})
    elif not tool_messages:
        out.append({"role": "user", "content": ""})
    return out


def _image_part(source: Any, where: str) -> dict:
    source = _obj(source)
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
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block, at))
        elif kind in ("thinking", "redacted_thinking"):
            _note(notes, _THINKING_NOTE)
        else:
            raise _unsupported(kind, at)
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
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise TranslationError("'tools' must be a list", "tools")
    out = []
    for k, tool in enumerate(tools):
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
    choice = _obj(choice)
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
    completion = _obj(completion)
    choice = _first_choice(completion.get("choices"))
    message = _obj(choice.get("message"))
    content: list[dict] = []
    text = _message_text(message)
    if text:
        content.append({"type": "text", "text": text})
    tool_calls = message.get("tool_calls")
    for k, call in enumerate(tool_calls if isinstance(tool_calls, list) else ()):
        block = _tool_use_block(call, k)
        if block is not None:
            content.append(block)
    return {
        "id": "msg_" + id_stem(completion.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,
        "usage": messages_usage(completion.get("usage")),
    }


def stop_reason(finish_reason: Any) -> str:
    """Chat `finish_reason` -> Anthropic `stop_reason` (anything unknown reads as end_turn)."""
    if not isinstance(finish_reason, str):
        return "end_turn"
    return STOP_REASONS.get(finish_reason, "end_turn")


def messages_usage(usage: Any) -> dict:
    """Chat usage -> Anthropic usage. Chat's `prompt_tokens` counts cache reads (and, from the
    gateway's own Anthropic translation, cache writes) too; Anthropic counts them apart."""
    usage = _obj(usage)
    details = _obj(usage.get("prompt_tokens_details"))
    prompt = token_count(usage.get("prompt_tokens"))
    cached = min(token_count(details.get("cached_tokens")), prompt)
    written = min(token_count(details.get("cache_write_tokens")), prompt - cached)
    return {
        "input_tokens": prompt - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": token_count(usage.get("completion_tokens")),
    }


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str) and content:
        return content
    if isinstance(content, list):  # some servers answer with parts
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        text = "".join(t for t in texts if isinstance(t, str))
        if text:
            return text
    refusal = message.get("refusal")
    return refusal if isinstance(refusal, str) else ""


def _tool_use_block(call: Any, k: int) -> dict | None:
    call = _obj(call)
    function = _obj(call.get("function"))
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return None
    call_id = call.get("id")
    return {
        "type": "tool_use",
        "id": call_id if isinstance(call_id, str) and call_id else _tool_use_id(k),
        "name": name,
        "input": _arguments_object(function.get("arguments")),
    }


def _arguments_object(arguments: Any) -> dict:
    if not isinstance(arguments, str):
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _first_choice(choices: Any) -> dict:
    if not isinstance(choices, list):
        return {}
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def _obj(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _tool_use_id(k: int) -> str:
    return f"toolu_{secrets.token_hex(8)}_{k}"


def id_stem(chat_id: Any) -> str:
    """A stable, id-safe stem of an upstream chat id (random when there is none), so the
    ids the client sees follow the upstream's and log lines can be matched."""
    if isinstance(chat_id, str):
        stem = _ID_CHARS.sub("", chat_id.removeprefix("chatcmpl-"))[:64]
        if stem:
            return stem
    return secrets.token_hex(12)


# --- streams ----------------------------------------------------------------------------------


def sse_event(kind: str, data: dict) -> bytes:
    """One SSE event; `data` already starts with its `type`."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ChatToMessagesStream:
    """Turns `chat.completion.chunk` dicts into Anthropic SSE events, one chunk at a time.

    Anthropic ends a message with `message_delta` (stop reason and usage) then `message_stop`;
    chat sends `finish_reason` first and usage in a later chunk, so the end is held until the
    usage arrives or `finish()` is called. Content is never held.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self._started = False
        self._done = False
        self._blocks = 0
        self._open: int | None = None  # the index of the open content block
        self._open_is_text = False
        self._tool_blocks: dict[int, int] = {}  # chat tool-call index -> block index
        self._finish_reason: Any = None
        self._usage: dict | None = None

    def feed(self, chunk: dict) -> list[bytes]:
        """Translate one chunk into zero or more whole SSE events."""
        if self._done or not isinstance(chunk, dict):
            return []
        events = self._start(chunk.get("id"))
        choice = _first_choice(chunk.get("choices"))
        delta = _obj(choice.get("delta"))
        content = delta.get("content")
        if isinstance(content, str) and content:
            events.extend(self._text(content))
        tool_calls = delta.get("tool_calls")
        for call in tool_calls if isinstance(tool_calls, list) else ():
            events.extend(self._tool_call(_obj(call)))
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and self._finish_reason is None:
            self._finish_reason = finish_reason
            events.extend(self._close_block())
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        if self._finish_reason is not None and self._usage is not None:
            events.extend(self.finish())
        return events

    def finish(self) -> list[bytes]:
        """The closing events: the open block's stop, `message_delta`, `message_stop`."""
        if self._done:
            return []
        events = self._start(None)
        events.extend(self._close_block())
        usage = messages_usage(self._usage)
        events.append(
            sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(self._finish_reason),
                        "stop_sequence": None,
                    },
                    "usage": usage,
                },
            )
        )
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        self._done = True
        return events

    def _start(self, chat_id: Any) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": "msg_" + id_stem(chat_id),
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

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self._open is None or not self._open_is_text:
            events.extend(self._close_block())
            events.append(self._open_block({"type": "text", "text": ""}, is_text=True))
        delta = {"type": "text_delta", "text": text}
        events.append(self._delta(self._open, delta))
        return events

    def _tool_call(self, call: dict) -> list[bytes]:
        index = call.get("index", 0)
        if type(index) is not int:
            index = 0
        function = _obj(call.get("function"))
        events = []
        block = self._tool_blocks.get(index)
        if block is None:
            events.extend(self._close_block())
            call_id, name = call.get("id"), function.get("name")
            content_block = {
                "type": "tool_use",
                "id": call_id if isinstance(call_id, str) and call_id else _tool_use_id(index),
                "name": name if isinstance(name, str) else "",
                "input": {},
            }
            events.append(self._open_block(content_block, is_text=False))
            block = self._tool_blocks[index] = self._blocks - 1
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            events.append(
                self._delta(block, {"type": "input_json_delta", "partial_json": fragment})
            )
        return events

    def _open_block(self, content_block: dict, *, is_text: bool) -> bytes:
        self._open = self._blocks
        self._open_is_text = is_text
        self._blocks += 1
        data = {"type": "content_block_start", "index": self._open, "content_block": content_block}
        return sse_event("content_block_start", data)

    def _delta(self, index: int | None, delta: dict) -> bytes:
        data = {"type": "content_block_delta", "index": index, "delta": delta}
        return sse_event("content_block_delta", data)

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]


# --- errors -----------------------------------------------------------------------------------


def chat_error_to_messages(status: int, error: dict) -> dict:
    """An OpenAI error body (`{"error": {...}}`, untrusted) -> an Anthropic error body."""
    inner = error.get("error") if isinstance(error, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else inner
    if not isinstance(message, str) or not message:
        message = f"upstream returned HTTP {status}"
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
