"""OpenAI chat request -> Gemini `generateContent` request (Google AI Studio and Vertex AI).

Gemini's shape differs from chat's: the system prompt is `systemInstruction`, turns are
`contents` of `parts` with the roles `user` and `model`, sampling settings sit in
`generationConfig`, a tool call is a `functionCall` part and its result a `functionResponse`
part named after the function (not after a call id). Gemini answers 400 to fields it does not
know, so an OpenAI body cannot go as it is; Gemini's own request fields sent through the OpenAI
SDK's `extra_body` (`GEMINI_NATIVE_FIELDS`) are forwarded as sent.

JSON Schemas (tool parameters, `response_format` json_schema) go as `parametersJsonSchema` and
`responseJsonSchema`, the fields that take JSON Schema verbatim: `parameters`/`responseSchema`
take an OpenAPI subset that rejects common JSON Schema keywords (`additionalProperties`,
`$defs`), and a lossy rewrite would change what the model is asked for.

The translation is pure and deterministic (same body, same bytes), so Gemini's implicit prefix
cache keeps hitting.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
from typing import Any

import orjson

from gateway.translation.chat_content import content_parts, part_text
from gateway.translation.chat_to_anthropic import TranslationError

# Gemini's own request fields, accepted from `extra_body` and forwarded as they are.
GEMINI_NATIVE_FIELDS = ("safetySettings", "cachedContent", "labels", "toolConfig")
# Chat fields mapped into `generationConfig` one to one.
GENERATION_FIELDS = (
    ("temperature", "temperature"),
    ("top_p", "topP"),
    ("top_k", "topK"),
    ("presence_penalty", "presencePenalty"),
    ("frequency_penalty", "frequencyPenalty"),
)
# Chat fields with no Gemini counterpart, dropped rather than sent (Gemini rejects unknown ones).
DROPPED_FIELDS = frozenset(
    {
        "logit_bias",
        "parallel_tool_calls",
        "service_tier",
        "store",
        "metadata",
        "stream_options",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "user",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
    }
)
# `reasoning_effort` as Google's own OpenAI-compatible endpoint maps it: token budgets on Gemini
# 2.5, thinking levels from Gemini 3 on; models before 2.5 do not think and get nothing.
THINKING_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": 24576}
THINKING_LEVELS = frozenset({"minimal", "low", "medium", "high"})
# A thought signature Gemini gave a function call rides back to it inside the call's id, the one
# field of a tool call that every OpenAI client returns unchanged with the next request.
SIGNATURE_SEPARATOR = "~sig~"


def to_gemini_request(body: dict) -> dict:
    """Translate an OpenAI chat completion request body into a `generateContent` body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TranslationError("'messages' must be a non-empty list", "messages")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise TranslationError(
            "legacy 'functions'/'function_call' are unsupported for Gemini models; use 'tools'",
            "functions",
        )
    system, contents = _translate_messages(messages)
    out: dict[str, Any] = {"contents": contents}
    if system:
        out["systemInstruction"] = {"parts": system}
    tools = body.get("tools")
    if tools:
        out["tools"] = [{"functionDeclarations": _function_declarations(tools)}]
        tool_config = _tool_config(body.get("tool_choice"))
        if tool_config is not None:
            out["toolConfig"] = tool_config
    config = _generation_config(body)
    if config:
        out["generationConfig"] = config
    for name in GEMINI_NATIVE_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


# --- generationConfig -------------------------------------------------------------------------


def _generation_config(body: dict) -> dict:
    config: dict[str, Any] = {}
    for name, gemini_name in GENERATION_FIELDS:
        value = body.get(name)
        if value is not None:
            config[gemini_name] = _number(value, name)
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            config["maxOutputTokens"] = _positive_int(value, name)
            break
    stop = body.get("stop")
    if stop is not None:
        sequences = [stop] if isinstance(stop, str) else stop
        if not isinstance(sequences, list) or not all(isinstance(s, str) for s in sequences):
            raise TranslationError("'stop' must be a string or a list of strings", "stop")
        config["stopSequences"] = list(sequences)
    n = body.get("n")
    if n is not None and n != 1:
        config["candidateCount"] = _positive_int(n, "n")
    seed = body.get("seed")
    if seed is not None:
        config["seed"] = _int(seed, "seed")
    if body.get("logprobs"):
        config["responseLogprobs"] = True
        if body.get("top_logprobs") is not None:
            config["logprobs"] = _int(body["top_logprobs"], "top_logprobs")
    config.update(_response_format(body.get("response_format")))
    thinking = _thinking(body.get("reasoning_effort"), body.get("model"))
    if thinking is not None:
        config["thinkingConfig"] = thinking
    native = body.get("generationConfig")
    if isinstance(native, dict):
        config.update(native)  # the client's own Gemini settings win over translated ones
    return config


def _response_format(response_format: Any) -> dict:
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"responseMimeType": "application/json"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise TranslationError(
                "'response_format.json_schema.schema' must be an object",
                "response_format.json_schema.schema",
            )
        return {"responseMimeType": "application/json", "responseJsonSchema": schema}
    raise TranslationError(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format"
    )


def _thinking(effort: Any, model: Any) -> dict | None:
    if not isinstance(effort, str) or not isinstance(model, str):
        return None
    name = model.lower().removeprefix("models/")
    if name.startswith(("gemini-1", "gemini-2.0")):
        return None
    if name.startswith("gemini-2"):
        budget = THINKING_BUDGETS.get(effort)
        return None if budget is None else {"thinkingBudget": budget}
    return {"thinkingLevel": effort} if effort in THINKING_LEVELS else None


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TranslationError(f"'{name}' must be a number", name)
    return value


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TranslationError(f"'{name}' must be an integer", name)
    return value


def _positive_int(value: Any, name: str) -> int:
    if _int(value, name) < 1:
        raise TranslationError(f"'{name}' must be a positive integer", name)
    return value


# --- messages ---------------------------------------------------------------------------------


def _translate_messages(messages: list) -> tuple[list[dict], list[dict]]:
    """System text parts, and the turns as `contents` (same-role neighbours merged: a tool
    call's results must come back together in the one turn after it)."""
    system: list[dict] = []
    contents: list[dict] = []
    call_names: dict[str, str] = {}  # tool call id -> function name, for functionResponse
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TranslationError("each message must be an object", where)
        role = message.get("role")
        if role in ("system", "developer"):
            for part in _parts(message.get("content"), where):
                if "text" not in part:
                    raise TranslationError("system messages may hold text only", f"{where}.content")
                system.append(part)
        elif role == "user":
            _append(contents, "user", _parts(message.get("content"), where))
        elif role == "assistant":
            _append(contents, "model", _model_parts(message, where, call_names))
        elif role == "tool":
            _append(contents, "user", [_function_response(message, where, call_names)])
        else:
            raise TranslationError(f"unsupported message role {role!r}", f"{where}.role")
    return system, contents


def _append(contents: list[dict], role: str, parts: list[dict]) -> None:
    if not parts:
        return
    if contents and contents[-1]["role"] == role:
        contents[-1]["parts"].extend(parts)
    else:
        contents.append({"role": role, "parts": list(parts)})


def _parts(content: Any, where: str) -> list[dict]:
    return content_parts(content, where, _text_part, _part)


def _text_part(text: str) -> dict:
    return {"text": text}


def _part(part: dict, where: str) -> dict | None:
    kind = part.get("type")
    if kind == "text":
        text = part_text(part, where)
        return {"text": text} if text else None
    if kind == "refusal":
        return {"text": str(part.get("refusal") or "")}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return _media_part(url, f"{where}.image_url.url")
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        fmt = audio.get("format") if isinstance(audio, dict) else None
        if not isinstance(data, str) or not isinstance(fmt, str):
            raise TranslationError(
                "'input_audio' needs 'data' and 'format'", f"{where}.input_audio"
            )
        return {"inlineData": {"mimeType": f"audio/{fmt}", "data": data}}
    if kind == "file":
        file = part.get("file")
        file = file if isinstance(file, dict) else {}
        if isinstance(file.get("file_data"), str):
            return _media_part(file["file_data"], f"{where}.file.file_data")
        if isinstance(file.get("file_id"), str):
            return {"fileData": {"fileUri": file["file_id"]}}
        raise TranslationError("a file part needs 'file_data' or 'file_id'", f"{where}.file")
    raise TranslationError(f"content part type {kind!r} is not supported for Gemini models", where)


def _media_part(url: Any, where: str) -> dict:
    """A data URL inline; an http(s) or gs:// URL by reference (Gemini fetches it)."""
    if not isinstance(url, str):
        raise TranslationError("expected a URL string", where)
    if url.startswith(("http://", "https://", "gs://")):
        mime, _ = mimetypes.guess_type(url.split("?", 1)[0])
        ref = {"mimeType": mime, "fileUri": url} if mime else {"fileUri": url}
        return {"fileData": ref}
    header, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise TranslationError("expected an http(s) URL or a base64 data: URL", where)
    mime = header[len("data:") : -len(";base64")].split(";")[0].strip().lower()
    return {"inlineData": {"mimeType": mime, "data": data}}


def _model_parts(message: dict, where: str, call_names: dict[str, str]) -> list[dict]:
    parts = _parts(message.get("content"), where)
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise TranslationError("'tool_calls' must be a list", f"{where}.tool_calls")
    for k, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        call_id = call.get("id") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call_id, str):
            raise TranslationError("a tool call needs an 'id' and a 'function'", at)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("a tool call needs a function name", f"{at}.function.name")
        try:
            args = orjson.loads(function.get("arguments") or "{}")
        except (orjson.JSONDecodeError, TypeError):
            args = None
        if not isinstance(args, dict):
            raise TranslationError(
                "tool call arguments must be a JSON object", f"{at}.function.arguments"
            )
        call_names[call_id] = name
        out: dict[str, Any] = {"functionCall": {"name": name, "args": args}}
        signature = call_id.partition(SIGNATURE_SEPARATOR)[2]
        if signature and _is_base64(signature):
            out["thoughtSignature"] = signature
        parts.append(out)
    return parts


def _is_base64(value: str) -> bool:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _function_response(message: dict, where: str, call_names: dict[str, str]) -> dict:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError("a tool message needs a 'tool_call_id'", f"{where}.tool_call_id")
    name = call_names.get(call_id) or message.get("name")
    if not isinstance(name, str) or not name:
        raise TranslationError(
            "a tool message must answer a tool call of an earlier assistant message",
            f"{where}.tool_call_id",
        )
    content = message.get("content")
    text = (
        content
        if isinstance(content, str)
        else "".join(p.get("text", "") for p in _parts(content, where) if "text" in p)
    )
    try:
        parsed = orjson.loads(text) if text.startswith("{") else None
    except orjson.JSONDecodeError:
        parsed = None
    response = parsed if isinstance(parsed, dict) else {"output": text}
    return {"functionResponse": {"name": name, "response": response}}


# --- tools ------------------------------------------------------------------------------------


def _function_declarations(tools: Any) -> list[dict]:
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
        if function.get("parameters"):
            entry["parametersJsonSchema"] = function["parameters"]
        out.append(entry)
    return out


def _tool_config(choice: Any) -> dict | None:
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[choice]
        return {"functionCallingConfig": {"mode": mode}}
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise TranslationError("tool_choice needs a function name", "tool_choice.function.name")
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}
    raise TranslationError(
        "tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice"
    )
