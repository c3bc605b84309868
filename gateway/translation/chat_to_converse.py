"""OpenAI chat request -> Bedrock Converse request (`/model/{id}/converse[-stream]`).

Converse and Anthropic's Messages API share their structure (a top-level system prompt,
alternating user/assistant turns, tool calls and results as content blocks), so the chat body is
first put in Anthropic's shape by `chat_to_anthropic`, with all its checks, merging and
`cache_control` placement, and those blocks are then renamed into Converse's: `text`, `image`,
`document`, `toolUse`, `toolResult`, and a `cachePoint` block after every block that carried a
`cache_control` marker (Converse's breakpoint). The model id goes in the URL, not the body.

Converse answers 400 to fields it does not know; its own top-level fields sent through the
OpenAI SDK's `extra_body` (CONVERSE_NATIVE_FIELDS) are forwarded as they are.
"""

from __future__ import annotations

from typing import Any

from gateway.translation.chat_to_anthropic import TranslationError, to_anthropic_request

CONVERSE_NATIVE_FIELDS = (
    "additionalModelRequestFields",
    "additionalModelResponseFieldPaths",
    "guardrailConfig",
    "performanceConfig",
    "promptVariables",
    "requestMetadata",
)
CACHE_POINT = {"cachePoint": {"type": "default"}}
_IMAGE_FORMATS = {
    "image/jpeg": "jpeg",
    "image/png": "png",
    "image/gif": "gif",
    "image/webp": "webp",
}


def to_converse_request(body: dict) -> dict:
    """Translate an OpenAI chat completion request body into a Converse body."""
    anthropic = to_anthropic_request(body, "")
    out: dict[str, Any] = {}
    system = _blocks(anthropic.get("system") or [], "system")
    if system:
        out["system"] = system
    out["messages"] = [
        {"role": turn["role"], "content": _blocks(turn["content"], f"messages[{i}]")}
        for i, turn in enumerate(anthropic["messages"])
    ]
    inference = _inference_config(body, anthropic)
    if inference:
        out["inferenceConfig"] = inference
    if anthropic.get("tools"):
        out["toolConfig"] = _tool_config(anthropic["tools"], anthropic.get("tool_choice"))
    for name in CONVERSE_NATIVE_FIELDS:
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _inference_config(body: dict, anthropic: dict) -> dict:
    config: dict[str, Any] = {}
    if body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None:
        config["maxTokens"] = anthropic["max_tokens"]
    if "temperature" in anthropic:
        config["temperature"] = anthropic["temperature"]
    if "top_p" in anthropic:
        config["topP"] = anthropic["top_p"]
    if anthropic.get("stop_sequences"):
        config["stopSequences"] = anthropic["stop_sequences"]
    return config


def _tool_config(tools: list[dict], choice: dict | None) -> dict:
    specs: list[dict] = []
    for tool in tools:
        spec: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            spec["description"] = tool["description"]
        spec["inputSchema"] = {"json": tool["input_schema"]}
        specs.append({"toolSpec": spec})
        if tool.get("cache_control") is not None:
            specs.append(CACHE_POINT)
    config: dict[str, Any] = {"tools": specs}
    kind = choice.get("type") if choice else None
    if kind == "auto":
        config["toolChoice"] = {"auto": {}}
    elif kind == "any":
        config["toolChoice"] = {"any": {}}
    elif kind == "tool" and choice is not None:
        config["toolChoice"] = {"tool": {"name": choice["name"]}}
    # "none" has no Converse counterpart: the tools stay listed (earlier toolUse blocks need
    # them) and the model chooses.
    return config


def _blocks(blocks: list[dict], where: str) -> list[dict]:
    out: list[dict] = []
    for block in blocks:
        out.append(_block(block, where))
        if block.get("cache_control") is not None:
            out.append(CACHE_POINT)
    return out


def _block(block: dict, where: str) -> dict:
    kind = block.get("type")
    if kind == "text":
        return {"text": block["text"]}
    if kind == "image":
        return {"image": _image(block["source"], where)}
    if kind == "document":
        source = block["source"]
        return {
            "document": {"format": "pdf", "name": "document", "source": {"bytes": source["data"]}}
        }
    if kind == "tool_use":
        return {
            "toolUse": {"toolUseId": block["id"], "name": block["name"], "input": block["input"]}
        }
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            parts = [{"text": content}]
        else:
            parts = [_block(b, where) for b in content or ()] or [{"text": ""}]
        return {"toolResult": {"toolUseId": block["tool_use_id"], "content": parts}}
    raise TranslationError(f"content of type {kind!r} is not supported on Converse", where)


def _image(source: dict, where: str) -> dict:
    if source.get("type") != "base64":
        raise TranslationError(
            "Converse takes images inline only: use a base64 data: URL, not an http(s) URL",
            where,
        )
    return {"format": _IMAGE_FORMATS[source["media_type"]], "source": {"bytes": source["data"]}}
