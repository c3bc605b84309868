"""canonicalize: the same logical request always leaves the gateway as the same bytes.

The gateway re-serializes bodies with ``orjson.dumps`` (insertion order kept, fixed separators
and escaping). What varies between clients, SDK versions and map iteration orders is the order
of keys. The safe default rewrites every object the gateway understands (the request, messages,
content parts, tool calls, tool wrappers, ``tool_choice``, ``response_format``) into one fixed
key order; unknown keys follow in sorted order. It never reorders a list, never touches text,
numbers or the inside of a JSON schema (key order there can steer structured output).

Messages and Responses bodies arrive as their chat-shaped view (``policies.shapes``): their
messages, text parts and tools (Anthropic's ``name``/``input_schema`` tools, the Responses API's
flat function tools) get a fixed key order too; content blocks that are not text or chat media
(tool_use, tool_result, thinking, Anthropic images and documents) and non-message Responses items
(``function_call``, ``reasoning``...) are left exactly as sent.

Opt-ins, each named: sort ``tools`` by function name; sort object keys inside tool definitions
(wrapper and schema alike; lists such as ``enum`` or ``required`` keep their order); move
volatile values out of the system prompt (``policies.volatile``); put retrieved passages into a
stable order (``policies.passages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies.config import CanonicalizeOptions
from policies.passages import sort_passage_runs
from policies.provider_limits import CACHE_FAMILIES, cache_family
from policies.request import (
    SYSTEM_ROLES,
    is_item,
    map_message_text,
    tool_function_name,
    type_of,
)
from policies.volatile import PlaceholderTable, insert_note, is_volatile_note, note_message

REQUEST_ORDER = (
    "model",
    "instructions",
    "system",
    "messages",
    "prompt",
    "suffix",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "temperature",
    "top_p",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "stream",
    "stream_options",
    "store",
    "metadata",
    "service_tier",
    "user",
    "prompt_cache_key",
    "prompt_cache_retention",
)
MESSAGE_ORDER = (
    "type",
    "role",
    "name",
    "content",
    "refusal",
    "tool_calls",
    "function_call",
    "tool_call_id",
)
PART_ORDER = ("type", "text", "image_url", "input_audio", "file", "url", "detail")
# Chat tools are {type, function}; flat Responses and Anthropic tools hold their fields directly.
TOOL_ORDER = ("type", "function", "name", "description", "parameters", "input_schema", "strict")
FUNCTION_ORDER = ("name", "description", "parameters", "strict")
TOOL_CALL_ORDER = ("id", "type", "function")
CALL_FUNCTION_ORDER = ("name", "arguments")
RESPONSE_FORMAT_ORDER = ("type", "json_schema")
JSON_SCHEMA_ORDER = ("name", "description", "schema", "strict")
_PART_PAYLOAD_ORDER = {
    "image_url": ("url", "detail"),
    "input_audio": ("data", "format"),
    "file": ("file_id", "filename", "file_data"),
}
# Parts whose keys are put in order; any other part (a tool or thinking block) is left as sent.
_ORDERED_PART_TYPES = frozenset(
    {"text", "input_text", "output_text", "image_url", "input_audio", "file", "refusal"}
)
# The Anthropic cache marker extension always comes last in its object.
_LAST = ("cache_control",)


# (order, key tuple) -> canonical key tuple; few distinct shapes occur, so this stays small.
_shapes: dict[tuple[Sequence[str], tuple[str, ...]], tuple[str, ...]] = {}
_MAX_SHAPES = 4096
_MAX_SHAPE_CHARS = 1024


def _canonical_keys(keys: tuple[str, ...], order: Sequence[str]) -> tuple[str, ...]:
    shape = (order, keys)
    cached = _shapes.get(shape)
    if cached is None:
        present = set(keys)
        known = [key for key in order if key in present]
        rest = sorted(key for key in keys if key not in order and key not in _LAST)
        cached = tuple(known + rest + [key for key in _LAST if key in present])
        if sum(map(len, keys)) <= _MAX_SHAPE_CHARS:  # a client's huge key names stay uncached
            if len(_shapes) >= _MAX_SHAPES:
                _shapes.clear()
            _shapes[shape] = cached
    return cached


def ordered(obj: Any, order: Sequence[str]) -> Any:
    """``obj`` with keys in ``order``, then unknown keys sorted, then ``cache_control``.

    Returns ``obj`` itself when its keys are already in that order (copy-on-write).
    """
    if not isinstance(obj, dict):
        return obj
    keys = tuple(obj)
    canonical = _canonical_keys(keys, order)
    if canonical == keys:
        return obj
    return {key: obj[key] for key in canonical}


def sort_keys_deep(value: Any) -> Any:
    """Sort object keys at every depth; lists keep their item order."""
    if isinstance(value, dict):
        return {key: sort_keys_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(item) for item in value]
    return value


def _canonical_part(part: Any) -> Any:
    if not isinstance(part, dict) or type_of(part) not in _ORDERED_PART_TYPES:
        return part
    result = ordered(part, PART_ORDER)
    if not isinstance(result, dict):
        return result
    for key, order in _PART_PAYLOAD_ORDER.items():
        value = result.get(key)
        if isinstance(value, dict):
            new_value = ordered(value, order)
            if new_value is not value:
                result = {**result, key: new_value}
    return result


def _canonical_list(items: list[Any], canonical_item) -> list[Any]:
    """``items`` itself when every item is already canonical, else a new list."""
    new_items = [canonical_item(item) for item in items]
    if all(new is old for new, old in zip(new_items, items, strict=False)):
        return items
    return new_items


def _replace(obj: dict, key: str, value: Any) -> dict:
    if obj.get(key) is value:
        return obj
    return {**obj, key: value}


def _canonical_message(message: Any) -> Any:
    if is_item(message):
        return message
    result = ordered(message, MESSAGE_ORDER)
    if not isinstance(result, dict):
        return result
    content = result.get("content")
    if isinstance(content, list):
        result = _replace(result, "content", _canonical_list(content, _canonical_part))
    calls = result.get("tool_calls")
    if isinstance(calls, list):
        result = _replace(result, "tool_calls", _canonical_list(calls, _canonical_call))
    if isinstance(result.get("function_call"), dict):
        result = _replace(
            result, "function_call", ordered(result["function_call"], CALL_FUNCTION_ORDER)
        )
    return result


def _canonical_call(call: Any) -> Any:
    result = ordered(call, TOOL_CALL_ORDER)
    if isinstance(result, dict) and isinstance(result.get("function"), dict):
        result = _replace(result, "function", ordered(result["function"], CALL_FUNCTION_ORDER))
    return result


def _canonical_tool(tool: Any, sort_keys: bool) -> Any:
    if sort_keys:
        return sort_keys_deep(tool)
    return _with_inner(ordered(tool, TOOL_ORDER), "function", FUNCTION_ORDER)


def _with_inner(obj: Any, key: str, order: Sequence[str]) -> Any:
    if isinstance(obj, dict) and isinstance(obj.get(key), dict):
        return _replace(obj, key, ordered(obj[key], order))
    return obj


def _canonical_response_format(value: Any) -> Any:
    return _with_inner(ordered(value, RESPONSE_FORMAT_ORDER), "json_schema", JSON_SCHEMA_ORDER)


def _canonical_tool_choice(value: Any) -> Any:
    return _with_inner(ordered(value, TOOL_ORDER), "function", ("name",))


class CanonicalizePolicy:
    name = "canonicalize"

    def __init__(self, options: CanonicalizeOptions) -> None:
        self.options = options

    def apply(self, body: dict, ctx: Any) -> tuple[dict, dict]:
        notes: dict[str, Any] = {}
        result = dict(ordered(body, REQUEST_ORDER))
        messages = result.get("messages")
        if isinstance(messages, list):
            if self.options.sort_passages:
                messages = [
                    message if is_item(message) else map_message_text(message, sort_passage_runs)
                    for message in messages
                ]
            if self.options.volatile:
                messages, replaced = _move_volatile(messages, _note_role(ctx))
                if replaced:
                    notes["volatile_values"] = replaced
            result["messages"] = _canonical_list(messages, _canonical_message)
        tools = result.get("tools")
        if isinstance(tools, list):
            if self.options.sort_tools:
                tools = sorted(tools, key=tool_function_name)
            sort_keys = self.options.sort_schema_keys
            result["tools"] = _canonical_list(tools, lambda tool: _canonical_tool(tool, sort_keys))
        if isinstance(result.get("tool_choice"), dict):
            result["tool_choice"] = _canonical_tool_choice(result["tool_choice"])
        if isinstance(result.get("response_format"), dict):
            result["response_format"] = _canonical_response_format(result["response_format"])
        if isinstance(result.get("stream_options"), dict):
            result["stream_options"] = ordered(result["stream_options"], ("include_usage",))
        return result, notes


def _note_role(ctx: Any) -> str:
    family = getattr(ctx, "cache_family", "") or cache_family(ctx.route_kind, ctx.model)
    rules = CACHE_FAMILIES.get(family)
    return "system" if rules is not None and rules.late_system else "user"


def _move_volatile(messages: list[Any], role: str) -> tuple[list[Any], int]:
    table = PlaceholderTable()
    rewritten = []
    for message in messages:
        if (
            isinstance(message, dict)
            and message.get("role") in SYSTEM_ROLES
            and not is_volatile_note(message)
        ):
            message = map_message_text(message, table.replace)
        rewritten.append(message)
    if not table.values:
        return messages, 0
    return insert_note(rewritten, note_message(table, role)), len(table.values)
