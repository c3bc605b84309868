"""OpenAI Responses requests -> OpenAI chat, and chat answers -> Responses.

Used by `POST /v1/responses` when the model is served by an `anthropic` or `local` route. Only
OpenAI keeps Responses state server-side and runs its built-in tools, so requests that lean on
either (`previous_response_id`, `conversation`, stored prompts, `background`, web search, ...)
fail with a `TranslationError` (a 400) rather than being answered without them. Responses built
here are never stored (`store: false`). Fields that only mean something to OpenAI's own servers
(`store`, `include`, `truncation`, `prompt_cache_key`, ...) are dropped without a word; the ones
a client would notice missing (`reasoning`, reasoning items) are named in `Translated.notes`.

`chat_answer` reads the chat answer, which is untrusted; here it becomes a `response` object,
or Responses stream events, none held past the chunk that made it.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.translation.chat_answer import (
    ChatStreamReader,
    obj,
    read_completion,
    read_usage,
    sse_event,
)
from gateway.translation.chat_to_anthropic import TranslationError
from gateway.translation.messages_chat import (
    Translated,
    copy_max_tokens,
    copy_sampling,
    finish_request,
    tool_list,
)

# Fields that need state only OpenAI keeps; answering without it would answer something else.
_STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt")

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")

# Chat finish reasons that end a response as `incomplete`, with the reason Responses gives.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


# --- request ----------------------------------------------------------------------------------


def responses_request_to_chat(body: dict) -> Translated:
    """Translate an OpenAI Responses request body into an OpenAI chat request body."""
    if not isinstance(body, dict):
        raise TranslationError("the request body must be a JSON object")
    for name in _STATEFUL_FIELDS:
        if body.get(name) is not None:
            raise TranslationError(
                f"'{name}' is only supported on OpenAI routes (they keep server-side state)", name
            )
    if body.get("background") is True:
        raise TranslationError("'background' is only supported on OpenAI routes", "background")
    notes: list[str] = []
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise TranslationError("'instructions' must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    messages.extend(_input_messages(body.get("input"), notes))
    if not messages:
        raise TranslationError("'input' must not be empty", "input")
    out["messages"] = messages

    copy_max_tokens(body, "max_output_tokens", out)
    copy_sampling(body, out)
    user = body.get("user")
    if isinstance(user, str) and user:
        out["user"] = user

    tools = _translate_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        tool_choice = _translate_tool_choice(body.get("tool_choice"))
        if tool_choice is not None:
            out["tool_choice"] = tool_choice
        parallel = body.get("parallel_tool_calls")
        if isinstance(parallel, bool):
            out["parallel_tool_calls"] = parallel
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    if body.get("reasoning") is not None:
        notes.append("reasoning dropped")
    return finish_request(body, out, notes)


def _input_messages(items: Any, notes: list[str]) -> list[dict]:
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise TranslationError("'input' must be a string or a list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise TranslationError("each input item must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _tool_call(item, where)
            last = messages[-1] if messages else None
            # A call follows the assistant text it came with, or the calls made alongside it:
            # chat holds them all in one assistant message.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_tool_message(item, where))
        elif kind == "reasoning":
            if "reasoning items dropped" not in notes:
                notes.append("reasoning items dropped")
        else:
            raise TranslationError(
                f"input item type {kind!r} is not supported for this model's route",
                f"{where}.type",
            )
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise TranslationError(
            "'role' must be 'user', 'assistant', 'system' or 'developer'", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise TranslationError("'content' must be a string or a list of parts", f"{where}.content")
    parts = [_part(part, f"{where}.content.{j}") for j, part in enumerate(content)]
    if role == "user":
        return {"role": role, "content": parts}
    # Chat takes text only from the other roles; a joined string is what every server reads.
    texts = []
    for j, part in enumerate(parts):
        if part["type"] != "text":
            raise TranslationError(
                f"{role} messages may hold text only", f"{where}.content.{j}.type"
            )
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


def _part(part: Any, where: str) -> dict:
    if not isinstance(part, dict):
        raise TranslationError("each content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise TranslationError("a text part needs a string 'text'", f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "refusal":
        refusal = part.get("refusal")
        return {"type": "text", "text": refusal if isinstance(refusal, str) else ""}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise TranslationError(
                "only images given by 'image_url' (a URL or data URL) are supported for this "
                "model's route; 'file_id' needs an OpenAI route",
                f"{where}.image_url",
            )
        image_url: dict[str, Any] = {"url": url}
        detail = part.get("detail")
        if isinstance(detail, str):
            image_url["detail"] = detail
        return {"type": "image_url", "image_url": image_url}
    raise TranslationError(
        f"content part type {kind!r} is not supported for this model's route", f"{where}.type"
    )


def _tool_call(item: dict, where: str) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError("a function_call needs a 'call_id'", f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise TranslationError("a function_call needs a 'name'", f"{where}.name")
    if not isinstance(arguments, str):
        raise TranslationError("a function_call needs string 'arguments'", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_message(item: dict, where: str) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError("a function_call_output needs a 'call_id'", f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, str):
        text = output
    elif isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            translated = _part(part, f"{where}.output.{j}")
            if translated["type"] != "text":
                raise TranslationError(
                    "function_call_output may hold text only for this model's route",
                    f"{where}.output.{j}.type",
                )
            texts.append(translated["text"])
        text = "".join(texts)
    else:
        raise TranslationError("'output' must be a string or a list of parts", f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _translate_tools(tools: Any) -> list[dict]:
    out = []
    for k, tool in enumerate(tool_list(tools)):
        tool = obj(tool)
        kind = tool.get("type")
        if kind != "function":
            raise TranslationError(
                f"tool type {kind!r}: built-in tools are only served by OpenAI routes; "
                "this model's route takes function tools only",
                "tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("a function tool needs a 'name'", f"tools.{k}.name")
        out.append({"type": "function", "function": _function(tool)})
    return out


def _function(tool: dict) -> dict:
    function: dict[str, Any] = {"name": tool["name"]}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    _copy_typed(tool, function, parameters=dict, strict=bool)
    return function


def _copy_typed(source: dict, target: dict, **types: type) -> None:
    """Copy each named field of `source` to `target` when its value has the given type."""
    for name, kind in types.items():
        value = source.get(name)
        if isinstance(value, kind):
            target[name] = value


def _translate_tool_choice(choice: Any) -> str | dict | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("tool_choice needs a function 'name'", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise TranslationError(
        "tool_choice must be 'auto', 'none', 'required' or a function on this model's route",
        "tool_choice",
    )


def _response_format(text: Any) -> dict | None:
    fmt = obj(text).get("format")
    if fmt is None:
        return None
    fmt = obj(fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        name = fmt.get("name")
        if not isinstance(schema, dict) or not isinstance(name, str):
            raise TranslationError("a json_schema format needs 'name' and 'schema'", "text.format")
        json_schema: dict[str, Any] = {"name": name, "schema": schema}
        _copy_typed(fmt, json_schema, description=str, strict=bool)
        return {"type": "json_schema", "json_schema": json_schema}
    raise TranslationError(
        "text.format type must be 'text', 'json_object' or 'json_schema'", "text.format.type"
    )


# The chat fields a Responses request's `text.format` became, and its own names for them.
_FORMAT_PARAMS = (
    ("response_format.json_schema.", "text.format."),
    ("response_format.json_schema", "text.format"),
    ("response_format.", "text.format."),
    ("response_format", "text.format"),
)


def chat_error_to_responses(error: dict) -> dict:
    """A chat error body whose `param` names the `response_format` the request was translated
    into, naming instead the `text.format` field the client sent (its message too)."""
    detail = error.get("error")
    if not isinstance(detail, dict) or not isinstance(detail.get("param"), str):
        return error
    param = detail["param"]
    for chat, own in _FORMAT_PARAMS:
        if param.startswith(chat):
            message = detail.get("message")
            if isinstance(message, str):
                message = message.replace(param, own + param[len(chat) :])
            return {
                **error,
                "error": {**detail, "param": own + param[len(chat) :], "message": message},
            }
    return error


# --- whole responses --------------------------------------------------------------------------


def chat_completion_to_response(completion: dict, request: dict, model: str) -> dict:
    """Translate a `chat.completion` into a Responses `response` object named `model`,
    echoing the settings of `request` (the client's Responses body) the way OpenAI does."""
    answer = read_completion(completion)
    stem = answer.stem
    output: list[dict] = []
    if answer.text:
        output.append(_message_item("msg_" + stem, answer.text, "completed"))
    for call in answer.tool_calls:
        output.append(
            _function_item(
                f"fc_{stem}_{call.position}",
                _call_id(call.call_id),
                call.name,
                call.arguments if call.arguments is not None else "{}",
                "completed",
            )
        )
    return _response(
        "resp_" + stem,
        _created(answer.created),
        request,
        model,
        output=output,
        finish_reason=answer.finish_reason,
        usage=answer.usage,
    )


def responses_usage(usage: Any) -> dict:
    """Chat usage -> Responses usage (both count cached input inside the input total)."""
    counts = read_usage(usage)
    return {
        "input_tokens": counts.prompt,
        "input_tokens_details": {
            "cached_tokens": counts.cached,
            "cache_write_tokens": min(counts.cache_write, counts.prompt),
        },
        "output_tokens": counts.completion,
        "output_tokens_details": {"reasoning_tokens": counts.reasoning},
        "total_tokens": counts.prompt + counts.completion,
    }


def _response(
    response_id: str,
    created_at: int,
    request: Any,
    model: str,
    *,
    output: list[dict],
    finish_reason: Any = None,
    usage: Any = None,
    in_progress: bool = False,
) -> dict:
    request = obj(request)
    incomplete = _INCOMPLETE_REASONS.get(finish_reason) if isinstance(finish_reason, str) else None
    if in_progress:
        status = "in_progress"
    else:
        status = "incomplete" if incomplete else "completed"
    instructions = request.get("instructions")
    metadata = request.get("metadata")
    parallel = request.get("parallel_tool_calls")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete and not in_progress else None,
        "instructions": instructions if isinstance(instructions, str) else None,
        "max_output_tokens": _positive_int(request.get("max_output_tokens")),
        "model": model,
        "output": output,
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "store": False,
        "temperature": _number(request.get("temperature")),
        "text": _echo_text(request.get("text")),
        "tool_choice": _echo_tool_choice(request.get("tool_choice")),
        "tools": _echo_tools(request.get("tools")),
        "top_p": _number(request.get("top_p")),
        "truncation": "disabled",
        "usage": None if in_progress else responses_usage(usage),
        "metadata": metadata if _is_str_map(metadata) else {},
    }


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _function_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def _echo_tools(tools: Any) -> list[dict]:
    out = []
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str):
            continue
        function = _function(tool)
        entry: dict[str, Any] = {"type": "function", "name": function["name"]}
        entry["description"] = function.get("description")
        entry["parameters"] = function.get("parameters")
        entry["strict"] = function.get("strict")
        out.append(entry)
    return out


def _echo_tool_choice(choice: Any) -> str | dict:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "name": name}
    return "auto"


def _echo_text(text: Any) -> dict:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}
    if kind == "json_schema":
        try:
            translated = _response_format(text)
        except TranslationError:
            translated = None
        if translated is not None:
            return {"format": {"type": "json_schema", **translated["json_schema"]}}
    return {"format": {"type": "text"}}


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _positive_int(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _created(value: Any) -> int:
    return value if type(value) is int and value > 0 else int(time.time())


def _call_id(value: Any) -> str:
    return value if isinstance(value, str) and value else "call_" + secrets.token_hex(12)


# --- streams ----------------------------------------------------------------------------------


class ChatToResponsesStream(ChatStreamReader):
    """Turns `chat.completion.chunk` dicts into Responses SSE events, one chunk at a time.

    Output items open as their first delta arrives and close when another item starts or the
    choice finishes; `response.completed` waits for chat's usage chunk (sent after the finish
    chunk) or `finish()`. Every event carries `sequence_number`, counting from 0.
    """

    def __init__(self, request: dict, model: str) -> None:
        super().__init__()
        self.request = request
        self.model = model
        self._seq = 0
        self._created_at = 0
        # The output so far, each item as it is (or will be) done; an item's index is its part.
        self._items: list[dict] = []

    def on_start(self, created: Any) -> list[bytes]:
        self._created_at = _created(created)
        snapshot = self._snapshot(final=False)
        return [
            self._event("response.created", {"response": snapshot}),
            self._event("response.in_progress", {"response": snapshot}),
        ]

    def on_text_start(self, part: int) -> list[bytes]:
        item_id = "msg_" + self._stem if part == 0 else f"msg_{self._stem}_{part}"
        self._items.append(_message_item(item_id, "", "completed"))
        added = _message_item(item_id, None, "in_progress")
        return [
            self._event("response.output_item.added", self._at(part, added)),
            self._event(
                "response.content_part.added", {**self._in_item(part), "part": _text_part("")}
            ),
        ]

    def on_text(self, part: int, text: str) -> list[bytes]:
        self._items[part]["content"][0]["text"] += text
        fields = {**self._in_item(part), "delta": text, "logprobs": []}
        return [self._event("response.output_text.delta", fields)]

    def on_tool_call_start(
        self, part: int, tool_index: int, call_id: str | None, name: str
    ) -> list[bytes]:
        item = _function_item(
            f"fc_{self._stem}_{tool_index}", _call_id(call_id), name, "", "completed"
        )
        self._items.append(item)
        added = {**item, "status": "in_progress"}
        return [self._event("response.output_item.added", self._at(part, added))]

    def on_tool_call_fragment(self, part: int, fragment: str) -> list[bytes]:
        self._items[part]["arguments"] += fragment
        fields = {"item_id": self._items[part]["id"], "output_index": part, "delta": fragment}
        return [self._event("response.function_call_arguments.delta", fields)]

    def on_close(self, part: int) -> list[bytes]:
        item = self._items[part]
        events = []
        if item["type"] == "message":
            text_part = item["content"][0]
            fields = {**self._in_item(part), "text": text_part["text"], "logprobs": []}
            events.append(self._event("response.output_text.done", fields))
            fields = {**self._in_item(part), "part": dict(text_part)}
            events.append(self._event("response.content_part.done", fields))
        else:
            # `name` as well: the openai SDK's types for this event require it in 2.x and 3.0
            # (a missing field fails them); later ones dropped it and take it as an extra.
            fields = {
                "item_id": item["id"],
                "output_index": part,
                "name": item["name"],
                "arguments": item["arguments"],
            }
            events.append(self._event("response.function_call_arguments.done", fields))
        events.append(self._event("response.output_item.done", self._at(part, dict(item))))
        return events

    def on_end(self) -> list[bytes]:
        response = self._snapshot(final=True)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event(kind, {"response": response})]

    def _snapshot(self, *, final: bool) -> dict:
        return _response(
            "resp_" + self._stem,
            self._created_at,
            self.request,
            self.model,
            output=[dict(item) for item in self._items] if final else [],
            finish_reason=self._finish_reason,
            usage=self._usage,
            in_progress=not final,
        )

    def _event(self, kind: str, fields: dict) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, data)

    def _at(self, index: int, item: dict) -> dict:
        return {"output_index": index, "item": item}

    def _in_item(self, index: int) -> dict:
        return {"item_id": self._items[index]["id"], "output_index": index, "content_index": 0}
