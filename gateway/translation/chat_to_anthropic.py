"""OpenAI chat request -> Anthropic Messages request.

The Messages API differs in shape (the system prompt sits at the top level, turns must alternate
user/assistant, tool calls and tool results are content blocks) and answers 400 to fields it does
not know, so an OpenAI body cannot be forwarded as it is. The translation is pure and
deterministic: one OpenAI body always gives the same Anthropic body, key order included, so the
bytes sent upstream stay stable and Anthropic's prompt cache keeps hitting.

`cache_control` is accepted as an extension wherever Anthropic takes it: on content parts, on a
whole message (it lands on that message's last block) and at the top level of a tool entry.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.translation.anthropic_structured import add_answer_tool, answer_tool
from gateway.translation.chat_content import content_parts, part_text
from gateway.translation.errors import TranslationError as TranslationError

DEFAULT_MAX_TOKENS = 4096

# OpenAI request fields that have no Anthropic counterpart. They are dropped rather than
# forwarded because the Messages API rejects unknown fields. `reasoning_effort` is among them:
# Anthropic's thinking settings differ by model generation, so clients that want thinking send
# Anthropic's own `thinking` / `output_config` (see ANTHROPIC_NATIVE_FIELDS).
DROPPED_FIELDS = frozenset(
    {
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "seed",
        "service_tier",
        "store",
        "metadata",
        "stream_options",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
        "reasoning_effort",
    }
)

# Anthropic's own request fields, accepted from the OpenAI SDK's `extra_body` and forwarded as is.
ANTHROPIC_NATIVE_FIELDS = ("top_k", "thinking", "output_config", "cache_control")

_IMAGE_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def to_anthropic_request(body: dict, model: str) -> dict:
    """Translate an OpenAI chat completion request body into an Anthropic Messages body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TranslationError("'messages' must be a non-empty list", "messages")
    _reject_untranslatable(body)
    answer = answer_tool(body)
    system, turns = _translate_messages(messages)

    out: dict[str, Any] = {"model": model, "max_tokens": _max_tokens(body)}
    if system:
        out["system"] = system
    out["messages"] = turns
    tools = body.get("tools")
    if tools:
        out["tools"] = _translate_tools(tools)
        tool_choice = _translate_tool_choice(
            body.get("tool_choice"), body.get("parallel_tool_calls")
        )
        if tool_choice is not None:
            out["tool_choice"] = tool_choice
    if answer is not None:
        add_answer_tool(out, answer)
    stop = body.get("stop")
    if stop is not None:
        out["stop_sequences"] = _stop_sequences(stop)
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            out[name] = _number(value, name)
    if "temperature" in out:
        # OpenAI accepts 0..2, Anthropic 0..1: clamp rather than have Anthropic reject the call.
        out["temperature"] = min(out["temperature"], 1.0)
    for name in ANTHROPIC_NATIVE_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    user = body.get("user")
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user}
    if body.get("stream"):
        out["stream"] = True
    return out


def _reject_untranslatable(body: dict) -> None:
    """Fail loudly on requests whose meaning would be lost, instead of answering something else."""
    n = body.get("n")
    if n not in (None, 1):
        raise TranslationError("Anthropic models return one choice; 'n' must be 1", "n")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise TranslationError(
            "legacy 'functions'/'function_call' are unsupported for Anthropic models; use 'tools'",
            "functions",
        )


def _max_tokens(body: dict) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TranslationError(f"'{name}' must be a positive integer", name)
        return value
    return DEFAULT_MAX_TOKENS


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TranslationError(f"'{name}' must be a number", name)
    return value


def _stop_sequences(stop: Any) -> list[str]:
    sequences = [stop] if isinstance(stop, str) else stop
    if not isinstance(sequences, list) or not all(isinstance(s, str) for s in sequences):
        raise TranslationError("'stop' must be a string or a list of strings", "stop")
    return list(sequences)


# --- messages ---------------------------------------------------------------------------------


def _translate_messages(messages: list) -> tuple[list[dict], list[dict]]:
    """Split OpenAI messages into Anthropic's top-level system blocks and alternating turns."""
    system: list[dict] = []
    turns: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TranslationError("each message must be an object", where)
        role = message.get("role")
        if role in ("system", "developer"):
            blocks = _content_blocks(message.get("content"), where)
            for block in blocks:
                if block["type"] != "text":
                    raise TranslationError("system messages may hold text only", f"{where}.content")
            system.extend(_with_message_cache_control(blocks, message))
        elif role == "user":
            blocks = _content_blocks(message.get("content"), where)
            _append_turn(turns, "user", _with_message_cache_control(blocks, message))
        elif role == "assistant":
            blocks = _assistant_blocks(message, where)
            _append_turn(turns, "assistant", _with_message_cache_control(blocks, message))
        elif role == "tool":
            block = _tool_result_block(message, where)
            _append_turn(turns, "user", _with_message_cache_control([block], message))
        else:
            raise TranslationError(f"unsupported message role {role!r}", f"{where}.role")
    for turn in turns:
        if turn["role"] == "user":
            _tool_results_first(turn["content"])
    return system, turns


def _append_turn(turns: list[dict], role: str, blocks: list[dict]) -> None:
    """Add blocks as a turn, merging into the previous one of the same role (Anthropic needs
    strict alternation; OpenAI allows e.g. several tool results or user messages in a row)."""
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": list(blocks)})


def _tool_results_first(blocks: list[dict]) -> None:
    """Anthropic wants a user turn's tool_result blocks before any other block; a stable
    reorder only matters when a tool message was merged with a following user message."""
    blocks.sort(key=lambda block: block["type"] != "tool_result")


def _with_message_cache_control(blocks: list[dict], message: dict) -> list[dict]:
    cache_control = message.get("cache_control")
    if cache_control is not None and blocks:
        blocks[-1] = {**blocks[-1], "cache_control": cache_control}
    return blocks


def _content_blocks(content: Any, where: str) -> list[dict]:
    return content_parts(content, where, _text_block, _part_block)


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _part_block(part: dict, where: str) -> dict | None:
    kind = part.get("type")
    if kind == "text":
        text = part_text(part, where)
        if not text:
            return None  # Anthropic rejects empty text blocks
        block: dict[str, Any] = {"type": "text", "text": text}
    elif kind == "refusal":
        block = {"type": "text", "text": str(part.get("refusal") or "")}
    elif kind == "image_url":
        block = _image_block(part.get("image_url"), f"{where}.image_url")
    elif kind == "file":
        block = _document_block(part.get("file"), f"{where}.file")
    else:
        raise TranslationError(
            f"content part type {kind!r} is not supported for Anthropic models", where
        )
    if part.get("cache_control") is not None:
        block["cache_control"] = part["cache_control"]
    return block


def _image_block(image_url: Any, where: str) -> dict:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise TranslationError("'image_url.url' must be a string", f"{where}.url")
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    media_type, data = _parse_base64_data_url(url, f"{where}.url")
    if media_type not in _IMAGE_MEDIA_TYPES:
        raise TranslationError(
            f"image type {media_type!r} is not supported; use jpeg, png, gif or webp",
            f"{where}.url",
        )
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _document_block(file: Any, where: str) -> dict:
    data_url = file.get("file_data") if isinstance(file, dict) else None
    if not isinstance(data_url, str):
        raise TranslationError("only inline 'file_data' (a PDF data URL) is supported", where)
    media_type, data = _parse_base64_data_url(data_url, f"{where}.file_data")
    if media_type != "application/pdf":
        raise TranslationError(
            "only PDF files are supported for Anthropic models", f"{where}.file_data"
        )
    return {
        "type": "document",
        "source": {"type": "base64", "media_type": media_type, "data": data},
    }


def _parse_base64_data_url(url: str, where: str) -> tuple[str, str]:
    """`data:<media type>;base64,<data>` -> (media type, data)."""
    header, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise TranslationError("expected an http(s) URL or a base64 data: URL", where)
    media_type = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    return media_type, data


def _assistant_blocks(message: dict, where: str) -> list[dict]:
    blocks = _content_blocks(message.get("content"), where)
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise TranslationError("'tool_calls' must be a list", f"{where}.tool_calls")
    for k, call in enumerate(tool_calls):
        blocks.append(_tool_use_block(call, f"{where}.tool_calls[{k}]"))
    return blocks


def _tool_use_block(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str):
        raise TranslationError("a tool call needs an 'id' and a 'function'", where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise TranslationError("a tool call needs a function name", f"{where}.function.name")
    arguments = function.get("arguments") or "{}"
    try:
        parsed = orjson.loads(arguments)
    except (orjson.JSONDecodeError, TypeError):
        raise TranslationError(
            "tool call arguments must be a JSON object", f"{where}.function.arguments"
        ) from None
    if not isinstance(parsed, dict):
        raise TranslationError(
            "tool call arguments must be a JSON object", f"{where}.function.arguments"
        )
    return {"type": "tool_use", "id": call["id"], "name": name, "input": parsed}


def _tool_result_block(message: dict, where: str) -> dict:
    tool_call_id = message.get("tool_call_id")
    if not isinstance(tool_call_id, str) or not tool_call_id:
        raise TranslationError("a tool message needs a 'tool_call_id'", f"{where}.tool_call_id")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_call_id}
    content = message.get("content")
    if isinstance(content, str):
        if content:
            block["content"] = content
    else:
        blocks = _content_blocks(content, where)
        if blocks:
            block["content"] = blocks
    return block


# --- tools ------------------------------------------------------------------------------------


def _translate_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise TranslationError("'tools' must be a list", "tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise TranslationError("only tools of type 'function' are supported", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TranslationError("a tool needs a function with a name", f"{where}.function.name")
        entry: dict[str, Any] = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
        if tool.get("cache_control") is not None:
            entry["cache_control"] = tool["cache_control"]
        out.append(entry)
    return out


def _translate_tool_choice(choice: Any, parallel_tool_calls: Any) -> dict | None:
    translated: dict[str, Any] | None
    if choice is None:
        translated = None
    elif choice == "auto":
        translated = {"type": "auto"}
    elif choice == "none":
        return {"type": "none"}
    elif choice == "required":
        translated = {"type": "any"}
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise TranslationError("tool_choice needs a function name", "tool_choice.function.name")
        translated = {"type": "tool", "name": name}
    else:
        raise TranslationError(
            "tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice"
        )
    if parallel_tool_calls is False:
        translated = translated or {"type": "auto"}
        translated["disable_parallel_tool_use"] = True
    return translated
