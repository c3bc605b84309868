"""Structured output (`response_format`) for Anthropic models, as a forced tool.

OpenAI clients ask for JSON with `response_format` (chat) or `text.format` (Responses, which
reaches this module as chat's `response_format`). Anthropic's Messages API has no such field on
every model, but every model takes a tool whose `input_schema` is a JSON schema and a
`tool_choice` that forces it: the tool's input is then JSON that follows the schema. So the
gateway adds one *answer tool* built from the client's schema and forces it, and on the way
back the answer tool's input becomes the message's `content` (the JSON as text), with
`finish_reason` `stop`, as an OpenAI model answers. The client's SDK (`parse`, instructor, dspy)
reads it exactly as it reads OpenAI's.

- `json_schema`: the answer tool is named after `json_schema.name`, described by its
  `description`, and takes its `schema` (a schema without a `type` is read as an object;
  Anthropic tools take object schemas only, as OpenAI's structured outputs do).
- `json_object`: the answer tool is `json_object`, with an open object schema, or the
  `schema` sent beside `type` (some clients, instructor's JSON_SCHEMA mode among them, send one
  there). A forced tool rather than a system instruction: its input is always a JSON object,
  never prose or a fenced block.
- With tools of the client's own, the answer tool is listed after them (their prefix stays
  cache-stable) and the model must call a tool: one of the client's, or the answer tool to
  answer (`tool_choice` `any`). A client's `tool_choice: "none"` forces the answer tool. A
  client's forced function stays forced and no answer tool is added: this turn's answer is that
  call (instructor's RESPONSES_TOOLS mode forces a function named like its `text.format`).
  Calls of the client's tools come back as `tool_calls`. When one of the client's tools has the
  schema's name, the answer tool is `<name>_answer`.
- Anthropic does not force a tool while extended thinking is on, so `response_format` with
  `thinking` is a 400 naming `response_format`.
- `json_schema.strict` is not sent on: Anthropic's strict tool use is not on every model, and
  the forced tool's input follows the schema the model is shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.translation.errors import TranslationError

JSON_OBJECT_TOOL = "json_object"

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_JSON_OBJECT_DESCRIPTION = "Give your answer as a JSON object, as the conversation asks."
_JSON_SCHEMA_DESCRIPTION = "Give your answer as JSON that follows this tool's input schema."


@dataclass(frozen=True, slots=True)
class AnswerTool:
    """The tool that carries a structured answer: its name, and its Anthropic tool entry."""

    name: str
    tool: dict


def answer_tool(body: dict) -> AnswerTool | None:
    """The answer tool for a chat body's `response_format`, None when it asks for text or the
    client forces a function of its own; a `TranslationError` naming the field the client sent
    when it cannot be expressed."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    tool = _answer_tool(body, fmt)
    if tool is None or (body.get("tools") and _forces_a_function(body.get("tool_choice"))):
        return None
    taken = _client_tool_names(body.get("tools"))
    if tool.name not in taken:
        return tool
    name = f"{tool.name[:57]}_answer"
    if name in taken:
        raise TranslationError(
            f"tools named {tool.name!r} and {name!r} are already among 'tools'; the structured "
            "answer needs a name of its own",
            "response_format",
        )
    return AnswerTool(name, {**tool.tool, "name": name})


def _forces_a_function(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("type") == "function"


def _client_tool_names(tools: Any) -> set[str]:
    names = set()
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            names.add(name)
    return names


def _answer_tool(body: dict, fmt: Any) -> AnswerTool | None:
    if not isinstance(fmt, dict):
        raise TranslationError("'response_format' must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        tool = _json_schema_tool(fmt.get("json_schema"))
    elif kind == "json_object":
        schema = fmt.get("schema")
        where = "response_format.schema"
        input_schema = _object_schema(schema, where) if schema is not None else dict(_OPEN_OBJECT)
        tool = AnswerTool(
            JSON_OBJECT_TOOL,
            {
                "name": JSON_OBJECT_TOOL,
                "description": _JSON_OBJECT_DESCRIPTION,
                "input_schema": input_schema,
            },
        )
    else:
        raise TranslationError(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
            "response_format.type",
        )
    if _thinking_on(body.get("thinking")):
        raise TranslationError(
            "'response_format' cannot be combined with 'thinking' for Anthropic models: "
            "the answer comes through a forced tool, which Anthropic does not allow while "
            "thinking",
            "response_format",
        )
    return tool


_OPEN_OBJECT: dict = {"type": "object", "additionalProperties": True}


def _json_schema_tool(spec: Any) -> AnswerTool:
    if not isinstance(spec, dict):
        raise TranslationError(
            "'response_format.json_schema' must be an object", "response_format.json_schema"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise TranslationError(
            "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
            "response_format.json_schema.name",
        )
    schema = spec.get("schema")
    where = "response_format.json_schema.schema"
    input_schema = _object_schema(schema, where) if schema is not None else dict(_OPEN_OBJECT)
    description = spec.get("description")
    entry = {
        "name": name,
        "description": description
        if isinstance(description, str) and description
        else _JSON_SCHEMA_DESCRIPTION,
        "input_schema": input_schema,
    }
    return AnswerTool(name, entry)


def _object_schema(schema: Any, where: str) -> dict:
    if not isinstance(schema, dict):
        raise TranslationError(f"'{where}' must be a JSON schema object", where)
    kind = schema.get("type")
    if kind is None:
        return {"type": "object", **schema}
    if kind != "object":
        raise TranslationError(
            f"'{where}' must describe an object (its type is {str(kind)[:40]!r}): an Anthropic "
            "tool's input is an object, as an OpenAI structured output's root is",
            where,
        )
    return schema


def _thinking_on(thinking: Any) -> bool:
    return isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled")


def add_answer_tool(out: dict, answer: AnswerTool) -> None:
    """Add `answer` (from `answer_tool`) to the Anthropic body `out`, which already holds the
    client's tools and their translated `tool_choice`, and set the `tool_choice` that makes the
    model answer through it (see the module's rules)."""
    tools = out.get("tools") or []
    out["tools"] = [*tools, answer.tool]
    choice = out.get("tool_choice") or {}
    kind = choice.get("type")
    if not tools or kind == "none":
        forced: dict = {"type": "tool", "name": answer.name}
    else:
        forced = {"type": "any"}
    if choice.get("disable_parallel_tool_use"):
        forced["disable_parallel_tool_use"] = True
    out["tool_choice"] = forced
