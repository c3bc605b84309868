"""Whether the policies can read a body at all: the containers they walk have the JSON types
they expect.

A door checks only what it needs to route a request, so a body may reach the chain with
``tools: 5`` (Messages), a ``messages`` entry that is a number, or content that is an object.
The policies then do nothing rather than fail one by one: ``unreadable`` names the first field
of the chat-shaped view (``policies.shapes``) whose type no policy reads, and the chain raises
``PolicyShapeError`` for it, which the gateway answers by forwarding the body unchanged (the
upstream judges it, as it would without the gateway). Odd types further in (a part whose
``type`` is a list) are each helper's to skip (``policies.request.type_of``).
"""

from __future__ import annotations

from typing import Any


class PolicyShapeError(ValueError):
    """A body whose shape the policies cannot read; `field` names the place, `kind` its type."""

    def __init__(self, field: str, kind: str) -> None:
        super().__init__(f"{field} is {kind}, which the policies do not read")
        self.field = field
        self.kind = kind


def unreadable(view: dict) -> PolicyShapeError | None:
    """The first field of the chat-shaped `view` whose type the policies cannot walk, or None."""
    messages = view.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            return PolicyShapeError("messages", _kind(messages))
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                return PolicyShapeError(f"messages[{index}]", _kind(message))
            content = message.get("content")
            if content is not None and not isinstance(content, str | list):
                return PolicyShapeError(f"messages[{index}].content", _kind(content))
    tools = view.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return PolicyShapeError("tools", _kind(tools))
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict):
                return PolicyShapeError(f"tools[{index}]", _kind(tool))
    return None


def _kind(value: Any) -> str:
    """The JSON type of `value`, for a log line (never the value: it is a tenant's data)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"
