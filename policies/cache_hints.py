"""cache_hints: tell the provider where the stable prefix ends.

- Routes of the ``anthropic`` cache family (``policies.provider_limits.cache_family``:
  Anthropic direct, Claude on Bedrock InvokeModel and on Vertex), for chat bodies (translated
  to Anthropic's API later) and native Messages bodies alike: when the client set no
  ``cache_control`` anywhere (tools, system blocks, messages, content blocks and the blocks
  inside a tool_result, top level), add up to four breakpoints, each only where the prefix
  before it reaches the model's minimum cacheable length: the end of the tools, the end of
  the system prompt, the end of the previous turn (a second read point when a turn adds more
  than the 20-block lookback) and the last message stable across turns (the last one before the
  volatile note). No breakpoint goes after a volatile value left in the system prompt (a
  clock, a request id): that write could never be read. Tools and system may use a longer
  TTL (``FIRSTTOKEN_CACHE_HINTS_HEAD_TTL``); longer TTLs come first, as Anthropic requires.
  Markers use the shared extension: a ``cache_control`` key on a content part (string
  content becomes one text part; never on a thinking block, which Anthropic refuses) or on a
  tool. On a Messages body the system prompt's breakpoint lands on the top-level ``system``
  blocks (``policies.shapes`` lowers it there).
- Routes of the ``bedrock_converse`` family: the same breakpoints, at the model's Converse
  minimum, on the models that support cache points (none on the others); the Converse
  converter turns each marker into a ``cachePoint`` block. Always the 5-minute TTL.
- Routes of the ``openai`` family (OpenAI and OpenAI-compatible hosts), for chat,
  completions and native Responses bodies: when the client set no
  ``prompt_cache_key``, set the prefix family key, so requests sharing a prefix are routed to
  the same cache machine. ``user`` is left as sent
  (billing and audit see it); the key simply does not include it.
- Automatic families (DeepSeek, Moonshot, Gemini), Azure OpenAI (which refuses
  ``prompt_cache_key`` on many deployments) and ``local`` routes: nothing; the provider (or
  the engine) caches prefixes on its own.

The notes always name the family (``family``), which the advisor reads.

The prefix family (``prefix_family_key``) hashes the tenant, the model, the set of tool names and
the system prompt with volatile values and passage bodies masked, so the usual cache-breakers
do not split a family: the cache-break diagnostics compare requests within one family.
"""

from __future__ import annotations

import hashlib
from typing import Any

from policies.lru import BoundedLRU
from policies.passages import find_passages, has_passage
from policies.provider_limits import (
    ANTHROPIC_MAX_BREAKPOINTS,
    CACHE_FAMILIES,
    anthropic_min_tokens,
    cache_family,
    min_cacheable_tokens,
)
from policies.request import (
    SYSTEM_ROLES,
    content_text,
    content_texts,
    is_empty_content,
    messages_of,
    role_of,
    tool_function_name,
    tools_of,
    type_of,
)
from policies.tokens import TOKENS_FOR_REPLY, count_message, count_tool
from policies.volatile import has_volatile, is_volatile_note, mask_volatile


def _digest(data: str, size: int) -> str:
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=size).hexdigest()


# A family's key is asked for on every request of the family (and again by the cache advisor
# for each shadow variant); what it is made of repeats, so it is kept by that: the texts' own
# hashes (computed once per text object) replace masking and digesting the system prompt anew.
# Weighed by the characters its keys hold: the hot families' system prompts, about 4 MB at most.
_family_keys: BoundedLRU[str] = BoundedLRU(max_entries=10_000, max_weight=4_000_000)


def prefix_family_key(body: dict, tenant: str, model: str) -> str:
    """``ft-<tenant hash 8>-<prefix shape hash 12>``: a stable name for a prompt's prefix family."""
    tools = tools_of(body) or []
    names = tuple(sorted(tool_function_name(tool) for tool in tools))
    system_texts: list[str] = []
    for message in body.get("messages") or ():
        if role_of(message) not in SYSTEM_ROLES:
            break
        system_texts.append(content_text(message.get("content")))
    prompt = None
    if "messages" not in body and isinstance(body.get("prompt"), str):
        prompt = body["prompt"][:2048]
    made_of = (tenant, model, names, tuple(system_texts), prompt)
    key = _family_keys.get(made_of)
    if key is None:
        key = _family_key(tenant, model, names, system_texts, prompt)
        weight = sum(map(len, system_texts)) + len(prompt or "") + sum(map(len, names)) + 64
        _family_keys.put(made_of, key, weight)
    return key


def _family_key(
    tenant: str, model: str, names: tuple[str, ...], system_texts: list[str], prompt: str | None
) -> str:
    shapes = []
    for text in system_texts:
        text = mask_volatile(text)
        shapes.append(_without_passage_bodies(text) if has_passage(text) else text)
    if prompt is not None:
        shapes.append(mask_volatile(prompt))
    shape = "\x1f".join([model, "\x1e".join(names), "\x1e".join(shapes)])
    return f"ft-{_digest(tenant, 4)}-{_digest(shape, 6)}"


def _without_passage_bodies(text: str) -> str:
    pieces: list[str] = []
    cursor = 0
    for passage in find_passages(text):
        pieces += (text[cursor : passage.start], passage.open_tag(text), "</passage>")
        cursor = passage.end
    pieces.append(text[cursor:])
    return "".join(pieces)


def has_cache_control(body: dict) -> bool:
    if body.get("cache_control") is not None:
        return True
    for tool in body.get("tools") or ():
        if isinstance(tool, dict) and tool.get("cache_control") is not None:
            return True
    for message in body.get("messages") or ():
        if isinstance(message, dict) and (
            message.get("cache_control") is not None or _parts_have_marker(message.get("content"))
        ):
            return True
    return False


def _parts_have_marker(content: Any, depth: int = 0) -> bool:
    """A marker on a content part, or on a block inside one (an Anthropic tool_result's)."""
    if not isinstance(content, list) or depth > 1:
        return False
    return any(
        isinstance(part, dict)
        and (
            part.get("cache_control") is not None
            or _parts_have_marker(part.get("content"), depth + 1)
        )
        for part in content
    )


def _marker(ttl: str) -> dict:
    return {"type": "ephemeral", "ttl": ttl} if ttl != "5m" else {"type": "ephemeral"}


_UNMARKABLE_PARTS = ("thinking", "redacted_thinking")


def _mark_content(content: Any, marker: dict) -> Any:
    """``content`` with the marker on its last part that may carry one; None if none may."""
    if isinstance(content, str):
        return [{"type": "text", "text": content, "cache_control": marker}]
    for index in range(len(content) - 1, -1, -1):
        part = content[index]
        if isinstance(part, dict) and type_of(part) not in _UNMARKABLE_PARTS:
            parts = list(content)
            parts[index] = {**part, "cache_control": marker}
            return parts
    return None


def _breakpoint_messages(messages: list[Any]) -> tuple[int | None, int | None, int | None]:
    """Indices of the system prompt's end, of the previous turn and of the last stable message."""
    system_end = None
    for index, message in enumerate(messages):
        if role_of(message) not in SYSTEM_ROLES:
            break
        system_end = index
    stable = [
        index
        for index, message in enumerate(messages)
        if not is_volatile_note(message)
        and isinstance(message, dict)
        and not is_empty_content(message.get("content"))
    ]
    last_stable = stable[-1] if stable else None
    previous_turn = None
    if last_stable is not None:
        for index in range(last_stable - 1, -1, -1):
            if role_of(messages[index]) == "assistant":
                before = index - 1
                if before in stable and role_of(messages[before]) in ("user", "tool"):
                    previous_turn = before
                break
    return system_end, previous_turn, last_stable


def _system_has_volatile(messages: list[Any]) -> bool:
    for message in messages:
        if role_of(message) not in SYSTEM_ROLES or is_volatile_note(message):
            return False
        if any(has_volatile(text) for text in content_texts(message.get("content"))):
            return True
    return False


def add_anthropic_breakpoints(body: dict, model: str, head_ttl: str) -> tuple[dict, list[str]]:
    """The body with breakpoints added, and where they went (e.g. ``["tools", "messages[4]"]``)."""
    return add_breakpoints(body, anthropic_min_tokens(model), head_ttl)


def add_breakpoints(body: dict, minimum: int, head_ttl: str) -> tuple[dict, list[str]]:
    """``add_anthropic_breakpoints`` with the minimum cacheable length given."""
    tools = tools_of(body) or []
    messages = messages_of(body) or []
    prefix = TOKENS_FOR_REPLY + sum(count_tool(tool) for tool in tools)
    placed: list[str] = []
    result = dict(body)
    if tools and prefix >= minimum and isinstance(tools[-1], dict):
        result["tools"] = [*tools[:-1], {**tools[-1], "cache_control": _marker(head_ttl)}]
        placed.append("tools")
    system_end, previous_turn, last_stable = _breakpoint_messages(messages)
    if _system_has_volatile(messages):
        # A clock or request id in the system prompt changes the prefix on every request: a
        # breakpoint after it would pay for a cache write that no later request can read.
        return result, placed
    targets: dict[int, str] = {}
    if system_end is not None and not is_empty_content(messages[system_end].get("content")):
        targets[system_end] = head_ttl
    for index in (previous_turn, last_stable):
        if index is not None:
            targets.setdefault(index, "5m")
    if targets:
        new_messages = list(messages)
        for index, message in enumerate(messages):
            prefix += count_message(message)
            ttl = targets.get(index)
            if ttl is None or prefix < minimum or len(placed) >= ANTHROPIC_MAX_BREAKPOINTS:
                continue
            marked = _mark_content(message["content"], _marker(ttl))
            if marked is None:
                continue
            new_messages[index] = {**message, "content": marked}
            placed.append(f"messages[{index}]")
        result["messages"] = new_messages
    return result, placed


def _family_of(ctx: Any) -> str:
    family = getattr(ctx, "cache_family", "")
    return family or cache_family(ctx.route_kind, ctx.model, getattr(ctx, "base_url", None))


class CacheHintsPolicy:
    name = "cache_hints"

    def __init__(self, head_ttl: str = "5m") -> None:
        self.head_ttl = head_ttl

    def apply(self, body: dict, ctx: Any) -> tuple[dict, dict]:
        family = _family_of(ctx)
        notes: dict[str, Any] = {"family": family}
        marker = CACHE_FAMILIES[family].marker if family in CACHE_FAMILIES else None
        if marker == "prompt_cache_key" and ctx.endpoint != "messages":
            if body.get("prompt_cache_key") is None:
                key = prefix_family_key(body, ctx.tenant, ctx.model)
                notes["prompt_cache_key"] = key
                return {**body, "prompt_cache_key": key}, notes
            return dict(body), notes
        if marker in ("cache_control", "cache_point") and ctx.endpoint in ("chat", "messages"):
            minimum = min_cacheable_tokens(family, ctx.model)
            if minimum is None:
                return dict(body), notes
            if has_cache_control(body):
                notes["client_breakpoints"] = True
                return dict(body), notes
            ttl = self.head_ttl if marker == "cache_control" else "5m"
            result, placed = add_breakpoints(body, minimum, ttl)
            if placed:
                notes["breakpoints"] = placed
            return result, notes
        return dict(body), notes
