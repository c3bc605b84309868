"""Reading an OpenAI chat answer, whole or streamed, for the translators that write it back
in another API's shape (`messages_chat`, `responses_chat`).

The answer comes from an upstream and is untrusted: every reader here tolerates any shape, and a
field of the wrong type reads as absent instead of failing the answer. Keeping the reading in one
place means both APIs see the same answer for the same bytes; only the writing differs.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.telemetry.usage import token_count

_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def obj(value: Any) -> dict:
    """`value` if it is a JSON object, else an empty one (so lookups on junk read as absent)."""
    return value if isinstance(value, dict) else {}


def first_choice(choices: Any) -> dict:
    """The choice with index 0 (the only one the gateway asks for), or `{}`."""
    if not isinstance(choices, list):
        return {}
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def id_stem(chat_id: Any) -> str:
    """A stable, id-safe stem of an upstream chat id (random when there is none), so the
    ids the client sees follow the upstream's and log lines can be matched."""
    if isinstance(chat_id, str):
        stem = _ID_CHARS.sub("", chat_id.removeprefix("chatcmpl-"))[:64]
        if stem:
            return stem
    return secrets.token_hex(12)


def sse_event(kind: str, data: dict) -> bytes:
    """One named SSE event; `data` already starts with its `type`."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# --- whole answers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One named tool call of a whole answer; `position` counts every entry of the upstream's
    list, unnamed ones included, so generated ids stay the same whichever are dropped."""

    position: int
    call_id: str | None  # None when the upstream gave no usable id
    name: str
    arguments: str | None  # None when the upstream's arguments are not a string


@dataclass(frozen=True)
class ChatAnswer:
    """What a `chat.completion` says, each field as the upstream sent it or absent; `stem`
    is the id stem of the answer (see `id_stem`)."""

    stem: str
    created: Any
    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: Any
    usage: Any


@dataclass(frozen=True)
class Usage:
    """Chat usage as non-negative counts; `cached` is clamped to `prompt` and `reasoning` to
    `completion`, `cache_write` is left as sent (each API clamps it its own way)."""

    prompt: int
    completion: int
    cached: int
    cache_write: int
    reasoning: int


def read_completion(completion: Any) -> ChatAnswer:
    """Read a whole `chat.completion` (untrusted) into its first choice's answer."""
    completion = obj(completion)
    choice = first_choice(completion.get("choices"))
    message = obj(choice.get("message"))
    tool_calls = message.get("tool_calls")
    calls = []
    for position, call in enumerate(tool_calls if isinstance(tool_calls, list) else ()):
        call = obj(call)
        function = obj(call.get("function"))
        name, call_id, arguments = function.get("name"), call.get("id"), function.get("arguments")
        if not isinstance(name, str) or not name:
            continue
        calls.append(
            ToolCall(
                position,
                call_id if isinstance(call_id, str) and call_id else None,
                name,
                arguments if isinstance(arguments, str) else None,
            )
        )
    return ChatAnswer(
        stem=id_stem(completion.get("id")),
        created=completion.get("created"),
        text=_message_text(message),
        tool_calls=tuple(calls),
        finish_reason=choice.get("finish_reason"),
        usage=completion.get("usage"),
    )


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str) and content:
        return content
    if isinstance(content, list):  # some servers answer with parts
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        text = "".join(t for t in texts if isinstance(t, str))
        if text:
            return text
    refusal = message.get("refusal")
    return refusal if isinstance(refusal, str) else ""


def read_usage(usage: Any) -> Usage:
    """Read chat `usage` (untrusted; junk counts as 0)."""
    usage = obj(usage)
    details = obj(usage.get("prompt_tokens_details"))
    output_details = obj(usage.get("completion_tokens_details"))
    prompt = token_count(usage.get("prompt_tokens"))
    completion = token_count(usage.get("completion_tokens"))
    return Usage(
        prompt=prompt,
        completion=completion,
        cached=min(token_count(details.get("cached_tokens")), prompt),
        cache_write=token_count(details.get("cache_write_tokens")),
        reasoning=min(token_count(output_details.get("reasoning_tokens")), completion),
    )


# --- streams ----------------------------------------------------------------------------------


class ChatStreamReader:
    """Reads `chat.completion.chunk` dicts one at a time and calls the hooks a writer of another
    API implements; every hook returns the whole SSE events it makes, so no token waits.

    The answer is written as numbered parts (content blocks, output items): text goes to the
    open text part or opens one; each chat tool-call index opens its own part on its first
    fragment. Opening a part closes the open one, and so does the finish reason. Chat sends
    `finish_reason` before usage, so the end is held until the usage chunk or `finish()`.
    """

    def __init__(self) -> None:
        self._started = False
        self._done = False
        self._stem = ""  # the id stem of the answer, set when it starts
        self._parts = 0
        self._open: int | None = None  # the number of the open part
        self._open_is_text = False
        self._tool_parts: dict[int, int] = {}  # chat tool-call index -> part number
        self._finish_reason: Any = None
        self._usage: dict | None = None

    # Hooks a writer implements.

    def on_start(self, created: Any) -> list[bytes]:
        """The opening events, once; `self._stem` is set and `created` is the first chunk's
        (or None)."""
        raise NotImplementedError

    def on_text_start(self, part: int) -> list[bytes]:
        """Open text part `part`."""
        raise NotImplementedError

    def on_text(self, part: int, text: str) -> list[bytes]:
        """A non-empty text delta for the open text part."""
        raise NotImplementedError

    def on_tool_call_start(
        self, part: int, tool_index: int, call_id: str | None, name: str
    ) -> list[bytes]:
        """Open part `part` for chat tool call `tool_index` (`call_id` None when unusable)."""
        raise NotImplementedError

    def on_tool_call_fragment(self, part: int, fragment: str) -> list[bytes]:
        """A non-empty arguments fragment for the tool call written as `part`."""
        raise NotImplementedError

    def on_close(self, part: int) -> list[bytes]:
        """Close part `part`."""
        raise NotImplementedError

    def on_end(self) -> list[bytes]:
        """The closing events, after the last part is closed."""
        raise NotImplementedError

    # The reading.

    def feed(self, chunk: dict) -> list[bytes]:
        """Translate one chunk into zero or more whole SSE events."""
        if self._done or not isinstance(chunk, dict):
            return []
        events = self._start(chunk.get("id"), chunk.get("created"))
        choice = first_choice(chunk.get("choices"))
        delta = obj(choice.get("delta"))
        content = delta.get("content")
        if isinstance(content, str) and content:
            events.extend(self._text(content))
        tool_calls = delta.get("tool_calls")
        for call in tool_calls if isinstance(tool_calls, list) else ():
            events.extend(self._tool_call(obj(call)))
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and self._finish_reason is None:
            self._finish_reason = finish_reason
            events.extend(self._close())
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        if self._finish_reason is not None and self._usage is not None:
            events.extend(self.finish())
        return events

    def finish(self) -> list[bytes]:
        """The closing events (none once the answer has ended)."""
        if self._done:
            return []
        events = self._start(None, None)
        events.extend(self._close())
        events.extend(self.on_end())
        self._done = True
        return events

    def _start(self, chat_id: Any, created: Any) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        self._stem = id_stem(chat_id)
        return self.on_start(created)

    def _open_part(self, *, is_text: bool) -> tuple[int, list[bytes]]:
        events = self._close()
        part = self._open = self._parts
        self._open_is_text = is_text
        self._parts += 1
        return part, events

    def _text(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        part = self._open
        if part is None or not self._open_is_text:
            part, events = self._open_part(is_text=True)
            events.extend(self.on_text_start(part))
        events.extend(self.on_text(part, text))
        return events

    def _tool_call(self, call: dict) -> list[bytes]:
        index = call.get("index", 0)
        if type(index) is not int:
            index = 0
        function = obj(call.get("function"))
        events: list[bytes] = []
        part = self._tool_parts.get(index)
        if part is None:
            part, events = self._open_part(is_text=False)
            self._tool_parts[index] = part
            call_id, name = call.get("id"), function.get("name")
            events.extend(
                self.on_tool_call_start(
                    part,
                    index,
                    call_id if isinstance(call_id, str) and call_id else None,
                    name if isinstance(name, str) else "",
                )
            )
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            events.extend(self.on_tool_call_fragment(part, fragment))
        return events

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        part, self._open = self._open, None
        return self.on_close(part)
