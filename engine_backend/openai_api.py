"""`LocalEngine`: OpenAI request dicts in, OpenAI response and chunk dicts out.

This is the one surface the gateway's `local` upstream and the standalone server call.
It turns a request into prompt ids (chat template or legacy prompt) and SamplingParams,
runs it on the AsyncEngine and shapes the outputs exactly like OpenAI's, including
`usage.prompt_tokens_details.cached_tokens` taken from the engine's prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine_backend.async_engine import AsyncEngine, RequestOutput, RequestStream
from engine_backend.sampling import SamplingParams
from engine_backend.tokenizer import ChatTemplateError, Tokenizer

MAX_STOP_STRINGS = 16
# A random-weight demo rarely emits an end token; without a cap one request could run
# to the end of the context on a CPU.
DEMO_DEFAULT_MAX_TOKENS = 256


class EngineRequestError(ValueError):
    """A request the engine cannot serve; the server answers it with HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    include_usage: bool
    cache_salt: str | None


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineRequestError(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise EngineRequestError(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise EngineRequestError(f"'{name}' must be an integer", name)
    return value


def _reject_unsupported(body: dict) -> None:
    n = _integer(body, "n")
    if n not in (None, 1):
        raise EngineRequestError("only n=1 is supported by the local engine", "n")
    best_of = _integer(body, "best_of")
    if best_of not in (None, 1):
        raise EngineRequestError("only best_of=1 is supported by the local engine", "best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0, ""):
            raise EngineRequestError(f"'{name}' is not supported by the local engine", name)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise EngineRequestError("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise EngineRequestError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return [s for s in stop if s]


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
                    "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise EngineRequestError(f"messages[{index}].content must be a string or a list",
                             "messages")


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise EngineRequestError("'messages' must be a non-empty list", "messages")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EngineRequestError(f"messages[{i}] must be an object with a 'role'",
                                     "messages")
        normalized.append({**message, "content": _message_text(message.get("content"), i)})
    return normalized


def _usage(out: RequestOutput | None, num_prompt_tokens: int) -> dict:
    completion = out.num_output_tokens if out else 0
    cached = out.num_cached_tokens if out else 0
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(reason: str | None) -> str:
    # The engine's own "abort" (it gave up on the sequence) has no OpenAI counterpart.
    return reason if reason in ("stop", "length") else "stop"


class LocalEngine:
    """The bundled engine behind an OpenAI-shaped API (dicts, no HTTP)."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, *, model_name: str,
                 description: str, isolate_tenants: bool = False,
                 default_max_tokens: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.description = description
        self.isolate_tenants = isolate_tenants
        self.default_max_tokens = default_max_tokens
        self.max_model_len = int(engine.config.max_model_len
                                 or engine.hf_config.get("max_position_embeddings") or 2048)
        self.created = int(time.time())
        self.async_engine = AsyncEngine(engine, tokenizer)

    @classmethod
    def from_model(cls, model: str | None = None, *, demo: bool = False,
                   device: str | None = None, dtype: str | None = None,
                   isolate_tenants: bool = False, **engine_kwargs: Any) -> "LocalEngine":
        """Load a model folder or Hugging Face id, or (model None, demo True) the demo."""
        from engine_backend.config import EngineConfig
        from engine_backend.demo import DEMO_DESCRIPTION, DEMO_MODEL_NAME, build_demo_model
        from engine_backend.hub import resolve_model
        from engine_backend.llm_engine import LLMEngine

        default_max_tokens = None
        if model is None:
            if not demo:
                raise ValueError("give a model path or id, or demo=True")
            path, name, description = build_demo_model(), DEMO_MODEL_NAME, DEMO_DESCRIPTION
            default_max_tokens = DEMO_DEFAULT_MAX_TOKENS
        else:
            path = resolve_model(model)
            name = os.path.basename(os.path.normpath(model)) if os.path.isdir(
                os.path.expanduser(model)) else model
            description = f"local engine serving {model}"
        config = EngineConfig(model=path, device=device, dtype=dtype, **engine_kwargs)
        engine = LLMEngine(config)
        return cls(engine, Tokenizer(path), model_name=name, description=description,
                   isolate_tenants=isolate_tenants, default_max_tokens=default_max_tokens)

    def model_cards(self) -> list[dict]:
        return [{"id": self.model_name, "object": "model", "created": self.created,
                 "owned_by": "firsttoken", "description": self.description,
                 "max_model_len": self.max_model_len}]

    async def start(self) -> None:
        self.async_engine.start()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.async_engine.shutdown)

    # -- request preparation ---------------------------------------------------------------

    def _prepare(self, body: Any, prompt_ids: list[int], prompt_param: str,
                 tenant: str | None) -> _Prepared:
        if len(prompt_ids) == 0:
            raise EngineRequestError("the prompt is empty", prompt_param)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise EngineRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len}", prompt_param)
        max_tokens = _integer(body, "max_completion_tokens")
        max_param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_param = _integer(body, "max_tokens"), "max_tokens"
        if max_tokens is None:
            max_tokens = min(room, self.default_max_tokens or room)
        elif max_tokens < 1:
            raise EngineRequestError(f"'{max_param}' must be at least 1", max_param)
        elif max_tokens > room:
            raise EngineRequestError(
                f"{len(prompt_ids)} prompt tokens + {max_param}={max_tokens} exceed this "
                f"model's context of {self.max_model_len}", max_param)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        top_k = _integer(body, "top_k") or 0
        if top_k < -1:
            raise EngineRequestError("'top_k' must be -1, 0 (off) or positive", "top_k")
        ignore_eos = bool(body.get("ignore_eos", False))
        stop_ids = ([] if ignore_eos or self.tokenizer.eos_token_id is None
                    else [self.tokenizer.eos_token_id])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=max(top_p, 1e-9),  # OpenAI allows 0: keep only the top token
            top_k=max(top_k, 0),
            seed=_integer(body, "seed"),
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
        )
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise EngineRequestError("'stream_options' must be an object", "stream_options")
        salt = tenant if (self.isolate_tenants and tenant) else None
        if isinstance(body.get("cache_salt"), str) and body["cache_salt"]:
            salt = f"{salt}:{body['cache_salt']}" if salt else body["cache_salt"]
        return _Prepared(prompt_ids, params, _stop_strings(body),
                         bool(options.get("include_usage")), salt)

    def _prepare_chat(self, body: Any, tenant: str | None) -> _Prepared:
        if not isinstance(body, dict):
            raise EngineRequestError("the request body must be a JSON object")
        _reject_unsupported(body)
        messages = _normalize_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise EngineRequestError("'tools' must be a list", "tools")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise EngineRequestError("'chat_template_kwargs' must be an object",
                                     "chat_template_kwargs")
        try:
            prompt_ids = self.tokenizer.encode_chat(messages, tools=tools or None, **extra)
        except ChatTemplateError as e:
            raise EngineRequestError(str(e), "messages") from e
        return self._prepare(body, prompt_ids, "messages", tenant)

    def _prepare_completion(self, body: Any, tenant: str | None) -> _Prepared:
        if not isinstance(body, dict):
            raise EngineRequestError("the request body must be a JSON object")
        _reject_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, list):
            raise EngineRequestError("batched prompts are not supported; send one prompt",
                                     "prompt")
        else:
            raise EngineRequestError("'prompt' must be a string or a list of token ids",
                                     "prompt")
        return self._prepare(body, prompt_ids, "prompt", tenant)

    async def _submit(self, prepared: _Prepared, prompt_param: str) -> RequestStream:
        try:
            return await self.async_engine.add_request(
                prepared.prompt_ids, prepared.params, stop=prepared.stop,
                cache_salt=prepared.cache_salt)
        except ValueError as e:  # the engine's own validation (e.g. ids out of vocab)
            raise EngineRequestError(str(e), prompt_param) from e

    # -- chat completions ------------------------------------------------------------------

    async def chat_completion_stream(self, body: dict, *,
                                     tenant: str | None = None) -> AsyncIterator[dict]:
        """Yield `chat.completion.chunk` dicts; closing the iterator aborts the request."""
        prepared = self._prepare_chat(body, tenant)
        stream = await self._submit(prepared, "messages")
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": None}
        if prepared.include_usage:
            base["usage"] = None

        def chunk(delta: dict, finish_reason: str | None = None) -> dict:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}

        last: RequestOutput | None = None
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for out in stream:
                last = out
                if out.text:
                    yield chunk({"content": out.text})
                if out.finished:
                    yield chunk({}, _finish_reason(out.finish_reason))
            if prepared.include_usage:
                yield {**base, "choices": [], "usage": _usage(last, len(prepared.prompt_ids))}
        finally:
            stream.abort()

    async def chat_completion(self, body: dict, *, tenant: str | None = None) -> dict:
        prepared = self._prepare_chat(body, tenant)
        stream = await self._submit(prepared, "messages")
        text, last = await self._collect(stream)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "system_fingerprint": None,
            "choices": [{"index": 0, "logprobs": None,
                         "message": {"role": "assistant", "content": text, "refusal": None},
                         "finish_reason": _finish_reason(last.finish_reason if last else None)}],
            "usage": _usage(last, len(prepared.prompt_ids)),
        }

    # -- legacy completions ----------------------------------------------------------------

    async def completion_stream(self, body: dict, *,
                                tenant: str | None = None) -> AsyncIterator[dict]:
        """Yield `text_completion` chunk dicts; closing the iterator aborts the request."""
        prepared = self._prepare_completion(body, tenant)
        stream = await self._submit(prepared, "prompt")
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": None}
        if prepared.include_usage:
            base["usage"] = None

        def chunk(text: str, finish_reason: str | None = None) -> dict:
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason}]}

        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
                if out.text:
                    yield chunk(out.text)
                if out.finished:
                    yield chunk("", _finish_reason(out.finish_reason))
            if prepared.include_usage:
                yield {**base, "choices": [], "usage": _usage(last, len(prepared.prompt_ids))}
        finally:
            stream.abort()

    async def completion(self, body: dict, *, tenant: str | None = None) -> dict:
        prepared = self._prepare_completion(body, tenant)
        stream = await self._submit(prepared, "prompt")
        text, last = await self._collect(stream)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": self.model_name, "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": _finish_reason(last.finish_reason if last else None)}],
            "usage": _usage(last, len(prepared.prompt_ids)),
        }

    @staticmethod
    async def _collect(stream: RequestStream) -> tuple[str, RequestOutput | None]:
        parts: list[str] = []
        last = None
        try:
            async for out in stream:
                parts.append(out.text)
                last = out
        finally:
            stream.abort()
        return "".join(parts), last
