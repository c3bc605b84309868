"""Run the chat-shaped policies on Anthropic Messages and OpenAI Responses bodies.

The policies read a chat body: ``messages`` with a leading system prompt, and ``tools``. Rather
than teach each policy two more shapes, ``lift`` presents a native body as a chat-shaped view
and ``lower`` writes the policies' output view back into the native shape, so every option,
and the split between safe rules and opt-ins, means the same thing on every endpoint.

The view of a native body:
- ``system`` (Messages) or ``instructions`` (Responses) becomes a leading ``system`` message in
  its own form (a string, or Anthropic's list of text blocks). It carries ``LIFTED_KEY`` so that
  ``lower`` can tell it from a system or developer message the client put in ``input``; the
  top-level key stays where it was, holding ``LIFTED``, so the body's key order survives.
- Messages' ``messages`` are kept as they are: their text blocks are rewritten like chat's text
  parts; tool_use, tool_result and thinking blocks count as payload, so a message holding one is
  never dropped or collapsed.
- Responses' ``input`` is renamed ``messages`` in place; a string input becomes one user
  message. Message items are rewritten like chat messages (``input_text``/``output_text`` parts
  like text parts); every other item (``function_call``, ``function_call_output``,
  ``reasoning``...) is passed through as the same object, never dropped, collapsed or moved.

The view is only ever read by the policies and by ``PolicyResult.measure``; what goes upstream
is ``lower``'s output. For ``chat`` and ``completions`` both functions are the identity.
"""

from __future__ import annotations

from typing import Any

from policies.request import content_text
from policies.volatile import is_volatile_note

NATIVE_ENDPOINTS = ("messages", "responses")
# Marks the view message lifted from ``system``/``instructions``; removed again by ``lower``.
LIFTED_KEY = "x-firsttoken-lifted"
# What the view holds under ``system``/``instructions``: the value now lives in messages[0].
LIFTED = "[firsttoken: lifted into messages[0]]"
_SYSTEM_KEY = {"messages": "system", "responses": "instructions"}
_INPUT_KEY = {"messages": "messages", "responses": "input"}


def _liftable(value: Any, endpoint: str) -> bool:
    if endpoint == "messages":
        return isinstance(value, str | list)
    return isinstance(value, str)


def lift(body: dict, endpoint: str) -> dict:
    """A chat-shaped view of a Messages or Responses body (see the module docstring)."""
    if endpoint not in NATIVE_ENDPOINTS:
        return body
    system_key, input_key = _SYSTEM_KEY[endpoint], _INPUT_KEY[endpoint]
    system = body.get(system_key)
    lifted = _liftable(system, endpoint)
    head = [{"role": "system", "content": system, LIFTED_KEY: True}] if lifted else []
    items = body.get(input_key)
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        items = []
    view: dict[str, Any] = {}
    for key, value in body.items():
        if key == system_key and lifted:
            view[key] = LIFTED
        elif key == input_key:
            view["messages"] = [*head, *items]
        elif key != "messages":  # a stray ``messages`` on a Responses body: the view's is ours
            view[key] = value
    if "messages" not in view:
        view["messages"] = [*head, *items]
    return view


def lower(view: dict, original: dict, endpoint: str) -> dict:
    """The body to send, in ``original``'s shape, from the policies' output ``view``.

    Every field comes from the view, in the view's key order (a field no policy changed is the
    original's own object); the lifted system prompt goes back to its top-level key, with any
    ``cache_control`` the policies put on it, or away when a policy dropped it as empty.
    """
    if endpoint not in NATIVE_ENDPOINTS:
        return view
    system_key, input_key = _SYSTEM_KEY[endpoint], _INPUT_KEY[endpoint]
    messages = view.get("messages")
    messages = messages if isinstance(messages, list) else []
    system: Any = None
    if messages and isinstance(messages[0], dict) and messages[0].get(LIFTED_KEY) is True:
        system, messages = messages[0]["content"], messages[1:]
        if endpoint == "responses" and not isinstance(system, str):
            system = content_text(system)
    lower_item = _lower_message_item if endpoint == "messages" else _lower_input_item
    items = [lower_item(message) for message in messages]
    out: dict[str, Any] = {}
    for key, value in view.items():
        if key == "messages":
            out[input_key] = _input_value(items, original.get(input_key), endpoint)
            if input_key not in original and not items:
                del out[input_key]
        elif key == system_key and value == LIFTED:
            if system is not None:
                out[system_key] = system
        else:
            out[key] = value
    if endpoint == "responses" and "messages" in original:  # not a Responses field: as sent
        out["messages"] = original["messages"]
    return out


def _input_value(items: list[Any], original: Any, endpoint: str) -> Any:
    """A Responses string input stays a string while it is still one plain user message."""
    if endpoint == "responses" and isinstance(original, str) and len(items) == 1:
        only = items[0]
        if (
            isinstance(only, dict)
            and set(only) == {"role", "content"}
            and only["role"] == "user"
            and isinstance(only["content"], str)
        ):
            return only["content"]
    return items


def _lower_message_item(message: Any) -> Any:
    """The volatile note becomes a user turn with a text block (Anthropic merges consecutive
    user turns, so alternation holds whatever role the note had in the view)."""
    if is_volatile_note(message) and (
        message.get("role") != "user" or isinstance(message.get("content"), str)
    ):
        return {"role": "user", "content": [{"type": "text", "text": _note_text(message)}]}
    return message


def _lower_input_item(message: Any) -> Any:
    """The volatile note becomes an input message item of the note's role."""
    if is_volatile_note(message) and "type" not in message:
        return {"type": "message", "role": message["role"], "content": _note_text(message)}
    return message


def _note_text(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else content_text(content)


__all__ = ["LIFTED", "LIFTED_KEY", "NATIVE_ENDPOINTS", "lift", "lower"]
