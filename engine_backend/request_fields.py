"""Every field of an OpenAI request that the engine reads, checked for type and range.

One engine thread serves every tenant at once, so a value it cannot handle (a top_k past
int64, a seed torch refuses, template arguments that break rendering) is turned away here,
with a 400 that names the field, before it can reach a step. `bool` is never a number here
(JSON `true` is not `1`). Fields the engine does not implement either get a 400 when set to
anything but their neutral value (hard constraints a caller relies on: n, logprobs,
logit_bias, min_tokens), or are type- and range-checked and ignored (soft shaping that many
clients send by habit: presence/frequency/repetition penalties, min_p).
"""

from __future__ import annotations

from typing import Any

from engine_backend.sampling import MAX_SEED, MAX_TOP_K, MIN_SEED

MAX_STOP_STRINGS = 16
# The engine holds back text that could still grow into a stop string, testing each prefix
# of each stop string at every step: cheap for real delimiters, not for megabyte ones.
MAX_STOP_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
# Every response chunk repeats the model name; the gateway's own default limit is 256.
MAX_MODEL_CHARS = 1024
# Template variables a caller may not replace through chat_template_kwargs: the engine sets
# them from the request itself, or they are the template's own helpers.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "raise_exception", "strftime_now"})


class EngineRequestError(ValueError):
    """A request the engine cannot serve; the server answers it with HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def request_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise EngineRequestError("the request body must be a JSON object")
    return body


def model(body: dict, served: str) -> str:
    """The model name the response carries: the one the client asked for, as OpenAI's SDKs and
    the gateway's routes (`local-*` matches many names) expect to read back; the served name
    when the request names none."""
    name = body.get("model")
    if name is None or name == "":
        return served
    if not isinstance(name, str) or len(name) > MAX_MODEL_CHARS:
        raise EngineRequestError(
            f"'model' must be a string of at most {MAX_MODEL_CHARS} characters", "model"
        )
    return name


def integer(body: dict, name: str, low: int, high: int) -> int | None:
    """An optional integer within [low, high] (JSON null means "not given")."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineRequestError(f"'{name}' must be an integer", name)
    if not low <= value <= high:
        raise EngineRequestError(f"'{name}' must be between {low} and {high}", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    """An optional finite number within [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineRequestError(f"'{name}' must be a number", name)
    if not low <= value <= high:  # NaN fails this too
        raise EngineRequestError(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise EngineRequestError(f"'{name}' must be a boolean", name)
    return value


def top_p(body: dict) -> float:
    """OpenAI accepts 0 (keep only the most likely token); the sampler needs p > 0."""
    return max(number(body, "top_p", 1.0, 0.0, 1.0), 1e-9)


def top_k(body: dict) -> int:
    """-1 and 0 both mean "off" (vLLM's and Hugging Face's conventions). A top_k past the
    vocabulary is "off" too; the bound only keeps the value inside an int32 tensor."""
    return max(integer(body, "top_k", -1, MAX_TOP_K) or 0, 0)


def seed(body: dict) -> int | None:
    """The range torch.Generator.manual_seed accepts (negative seeds wrap to uint64)."""
    return integer(body, "seed", MIN_SEED, MAX_SEED)


def max_tokens(body: dict) -> tuple[int | None, str]:
    """The requested output budget and the field it came from; max_completion_tokens wins.
    Both are checked, so a bad value is never hidden by the other one."""
    legacy = integer(body, "max_tokens", 1, 2**63 - 1)
    current = integer(body, "max_completion_tokens", 1, 2**63 - 1)
    if current is not None:
        return current, "max_completion_tokens"
    return legacy, "max_tokens"


def check_ignored(body: dict) -> None:
    """Fields the engine accepts but does not apply: still a 400 when malformed."""
    number(body, "presence_penalty", 0.0, -2.0, 2.0)
    number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    number(body, "repetition_penalty", 1.0, 0.0, 2.0)
    number(body, "min_p", 0.0, 0.0, 1.0)


def reject_unsupported(body: dict) -> None:
    """Hard constraints the engine cannot honour: an error beats a silently different answer."""
    if integer(body, "n", 1, 128) not in (None, 1):
        raise EngineRequestError("only n=1 is supported by the local engine", "n")
    if integer(body, "best_of", 1, 128) not in (None, 1):
        raise EngineRequestError("only best_of=1 is supported by the local engine", "best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0, ""):
            raise EngineRequestError(f"'{name}' is not supported by the local engine", name)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise EngineRequestError("'logit_bias' must be an object", "logit_bias")
        if bias:
            raise EngineRequestError(
                "'logit_bias' is not supported by the local engine", "logit_bias"
            )
    if integer(body, "min_tokens", 0, 2**63 - 1):
        raise EngineRequestError("'min_tokens' is not supported by the local engine", "min_tokens")


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise EngineRequestError("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise EngineRequestError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise EngineRequestError(f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
    return [s for s in stop if s]


def include_usage(body: dict) -> bool:
    boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise EngineRequestError("'stream_options' must be an object", "stream_options")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise EngineRequestError(
            "'stream_options.include_usage' must be a boolean", "stream_options"
        )
    return bool(value)


def cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is None or salt == "":
        return None
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise EngineRequestError(
            f"'cache_salt' must be a string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    return salt


def _message_text(content: Any, index: int) -> str | None:
    """OpenAI content is a string or a list of parts; the engine reads text parts only."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise EngineRequestError(
                    f"messages[{index}]: content part {kind!r} is not supported (text only)",
                    "messages",
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise EngineRequestError(
                    f"messages[{index}]: a text part's 'text' must be a string", "messages"
                )
            texts.append(text)
        return "".join(texts)
    raise EngineRequestError(f"messages[{index}].content must be a string or a list", "messages")


def chat_messages(body: dict) -> list[dict]:
    """Messages with text content; the fields templates read have the types they expect."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineRequestError("'messages' must be a non-empty list", "messages")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EngineRequestError(f"messages[{i}] must be an object with a 'role'", "messages")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise EngineRequestError(f"messages[{i}].{key} must be a string", "messages")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise EngineRequestError(
                f"messages[{i}].tool_calls must be a list of objects", "messages"
            )
        normalized.append({**message, "content": _message_text(message.get("content"), i)})
    return normalized


def tools(body: dict) -> list[dict] | None:
    """A list of tool objects; a function tool has a `function` object with a string name."""
    value = body.get("tools")
    if value is None:
        return None
    if not isinstance(value, list):
        raise EngineRequestError("'tools' must be a list", "tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise EngineRequestError(f"tools[{i}] must be an object", "tools")
        function = tool.get("function")
        if function is None:
            continue
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise EngineRequestError(
                f"tools[{i}].function must be an object with a 'name'", "tools"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise EngineRequestError(f"tools[{i}].function.parameters must be an object", "tools")
    return value or None


def template_kwargs(body: dict) -> tuple[dict, bool]:
    """chat_template_kwargs (an object) and add_generation_prompt taken out of it."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return {}, True
    if not isinstance(extra, dict):
        raise EngineRequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(extra)
    if reserved:
        raise EngineRequestError(
            f"chat_template_kwargs may not set {sorted(reserved)[0]!r} (send tools in 'tools')",
            "chat_template_kwargs",
        )
    extra = dict(extra)
    generation_prompt = extra.pop("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise EngineRequestError(
            "chat_template_kwargs.add_generation_prompt must be a boolean", "chat_template_kwargs"
        )
    return extra, generation_prompt
