"""Read and rewrite the text inside an OpenAI-format request without mutating it.

A message's ``content`` is a string, a list of content parts, or ``None``. Policies only ever
rewrite text (string content and text parts: chat's and Anthropic's ``{"type": "text"}``, the
Responses API's ``input_text`` and ``output_text``, each keeping its own type); images, audio,
files, tool blocks and thinking blocks pass through.
Rewrites are copy-on-write: unchanged objects are shared with the input, changed ones are new.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

SYSTEM_ROLES = ("system", "developer")
# Keys whose presence means a message carries something besides its content.
_PAYLOAD_KEYS = ("tool_calls", "function_call", "audio", "refusal")
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
# Content parts that are text or media. Any other part (Anthropic's tool_use, tool_result,
# thinking blocks...) is a payload: a message holding one is never dropped or collapsed.
_CONTENT_PART_TYPES = TEXT_PART_TYPES | {
    "image_url",
    "input_audio",
    "file",
    "refusal",
    "image",
    "document",
    "input_image",
    "input_file",
}


def type_of(part: Any) -> str | None:
    """A part's or item's ``type`` when it is a string, else None: a client's ``["text"]`` or
    ``{}`` is never looked up in a set or compared as a name."""
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if isinstance(kind, str) else None


def is_text_part(part: Any) -> bool:
    return type_of(part) in TEXT_PART_TYPES and isinstance(part.get("text"), str)


def is_item(message: Any) -> bool:
    """True for a Responses input item that is not a message (``function_call``,
    ``function_call_output``, ``reasoning``...): policies pass it through untouched."""
    return isinstance(message, dict) and message.get("type", "message") != "message"


def content_texts(content: Any) -> Iterator[str]:
    """Yield every text of a message content, in order."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if is_text_part(part):
                yield part["text"]


def content_text(content: Any) -> str:
    return "\n".join(content_texts(content))


def map_content_text(content: Any, rewrite: Callable[[str], str]) -> Any:
    """Apply ``rewrite`` to each text of ``content``; ``content`` itself if nothing changed."""
    if isinstance(content, str):
        return rewrite(content)
    if not isinstance(content, list):
        return content
    parts: list[Any] | None = None
    for index, part in enumerate(content):
        if not is_text_part(part):
            continue
        new_text = rewrite(part["text"])
        if new_text != part["text"]:
            if parts is None:
                parts = list(content)
            parts[index] = {**part, "text": new_text}
    return content if parts is None else parts


def map_message_text(message: Any, rewrite: Callable[[str], str]) -> Any:
    if not isinstance(message, dict) or "content" not in message:
        return message
    content = message["content"]
    new_content = map_content_text(content, rewrite)
    if new_content is content:
        return message
    return {**message, "content": new_content}


def is_empty_content(content: Any) -> bool:
    if content is None:
        return True
    if isinstance(content, str):
        return not content or content.isspace()
    if isinstance(content, list):
        return all(
            is_text_part(part) and (not part["text"] or part["text"].isspace()) for part in content
        )
    return False


def carries_payload(message: dict) -> bool:
    """True when a message holds tool calls, audio, a refusal or a tool or thinking block besides
    its text, or is a non-message Responses item."""
    if any(message.get(key) for key in _PAYLOAD_KEYS) or is_item(message):
        return True
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(part, dict) and is_payload_part(part) for part in content
    )


def is_payload_part(part: dict) -> bool:
    kind = part.get("type")
    return isinstance(kind, str) and kind not in _CONTENT_PART_TYPES


def messages_of(body: dict) -> list[Any] | None:
    messages = body.get("messages")
    return messages if isinstance(messages, list) else None


def tools_of(body: dict) -> list[Any] | None:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else None


def role_of(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return role if isinstance(role, str) else None


def tool_function_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        if isinstance(tool.get("name"), str):
            return tool["name"]
    return ""
