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

from engine_backend import request_fields as fields
from engine_backend.async_engine import AsyncEngine, RequestOutput, RequestStream
from engine_backend.request_fields import EngineRequestError
from engine_backend.sampling import SamplingParams
from engine_backend.tokenizer import ChatTemplateError, ChatTemplateRenderError, Tokenizer

__all__ = ["EngineRequestError", "LocalEngine"]

# A random-weight demo rarely emits an end token; without a cap one request could run
# to the end of the context on a CPU.
DEMO_DEFAULT_MAX_TOKENS = 256


@dataclass
class _Checked:
    body: dict
    max_tokens: int | None
    max_param: str
    sampling: dict[str, Any]
    stop: list[str]
    include_usage: bool
    cache_salt: str | None


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    include_usage: bool
    cache_salt: str | None


def _usage(out: RequestOutput | None, num_prompt_tokens: int) -> dict:
    completion = out.num_output_tokens if out else 0
    cached = out.num_cached_tokens if out else 0
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish_reason(reason: str | None) -> str:
    # The engine's own "abort" (it gave up on the sequence) has no OpenAI counterpart.
    return reason if reason in ("stop", "length") else "stop"


class LocalEngine:
    """The bundled engine behind an OpenAI-shaped API (dicts, no HTTP)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        description: str,
        isolate_tenants: bool = False,
        default_max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.description = description
        self.isolate_tenants = isolate_tenants
        self.default_max_tokens = default_max_tokens
        self.max_model_len = int(
            engine.config.max_model_len or engine.hf_config.get("max_position_embeddings") or 2048
        )
        self.created = int(time.time())
        self.async_engine = AsyncEngine(engine, tokenizer)

    @classmethod
    def from_model(
        cls,
        model: str | None = None,
        *,
        demo: bool = False,
        device: str | None = None,
        dtype: str | None = None,
        isolate_tenants: bool = False,
        **engine_kwargs: Any,
    ) -> LocalEngine:
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
            name = (
                os.path.basename(os.path.normpath(model))
                if os.path.isdir(os.path.expanduser(model))
                else model
            )
            description = f"local engine serving {model}"
        config = EngineConfig(model=path, device=device, dtype=dtype, **engine_kwargs)
        engine = LLMEngine(config)
        return cls(
            engine,
            Tokenizer(path),
            model_name=name,
            description=description,
            isolate_tenants=isolate_tenants,
            default_max_tokens=default_max_tokens,
        )

    def model_cards(self) -> list[dict]:
        return [
            {
                "id": self.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "firsttoken",
                "description": self.description,
                "max_model_len": self.max_model_len,
            }
        ]

    async def start(self) -> None:
        self.async_engine.start()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.async_engine.shutdown)

    # -- request preparation ---------------------------------------------------------------

    def _check(self, body: Any, tenant: str | None) -> _Checked:
        """Every field except the prompt, checked for type and range first, so that a bad one
        costs no template rendering or tokenization."""
        body = fields.request_object(body)
        fields.reject_unsupported(body)
        fields.check_ignored(body)
        max_tokens, max_param = fields.max_tokens(body)
        ignore_eos = fields.boolean(body, "ignore_eos")
        sampling = dict(
            temperature=fields.number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=fields.top_p(body),
            top_k=fields.top_k(body),
            seed=fields.seed(body),
            ignore_eos=ignore_eos,
            stop_token_ids=(
                []
                if ignore_eos or self.tokenizer.eos_token_id is None
                else [self.tokenizer.eos_token_id]
            ),
        )
        salt = tenant if (self.isolate_tenants and tenant) else None
        own_salt = fields.cache_salt(body)
        if own_salt:
            salt = f"{salt}:{own_salt}" if salt else own_salt
        return _Checked(
            body,
            max_tokens,
            max_param,
            sampling,
            fields.stop_strings(body),
            fields.include_usage(body),
            salt,
        )

    def _prepare(self, checked: _Checked, prompt_ids: list[int], prompt_param: str) -> _Prepared:
        """The checked fields plus the prompt. A max_tokens that does not fit the context is a
        400 (as OpenAI answers it), never silently clamped."""
        if len(prompt_ids) == 0:
            raise EngineRequestError("the prompt is empty", prompt_param)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise EngineRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len}",
                prompt_param,
            )
        max_tokens, max_param = checked.max_tokens, checked.max_param
        if max_tokens is None:
            max_tokens = min(room, self.default_max_tokens or room)
        elif max_tokens > room:
            raise EngineRequestError(
                f"{len(prompt_ids)} prompt tokens + {max_param}={max_tokens} exceed this "
                f"model's context of {self.max_model_len}",
                max_param,
            )
        try:
            params = SamplingParams(max_tokens=max_tokens, **checked.sampling)
        except ValueError as e:  # the engine's own bounds; the checks above name the field first
            raise EngineRequestError(str(e)) from e
        return _Prepared(
            prompt_ids, params, checked.stop, checked.include_usage, checked.cache_salt
        )

    def _prepare_chat(self, body: Any, tenant: str | None) -> _Prepared:
        checked = self._check(body, tenant)
        body = checked.body
        messages = fields.chat_messages(body)
        tools = fields.tools(body)
        extra, generation_prompt = fields.template_kwargs(body)
        try:
            prompt_ids = self.tokenizer.encode_chat(
                messages, tools=tools, add_generation_prompt=generation_prompt, **extra
            )
        except ChatTemplateRenderError as e:
            param = "chat_template_kwargs" if extra else "tools" if tools else "messages"
            raise EngineRequestError(str(e), param) from e
        except ChatTemplateError as e:  # the template refused the conversation
            raise EngineRequestError(str(e), "messages") from e
        return self._prepare(checked, prompt_ids, "messages")

    def _prepare_completion(self, body: Any, tenant: str | None) -> _Prepared:
        checked = self._check(body, tenant)
        prompt = checked.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            prompt_ids = list(prompt)
        elif isinstance(prompt, list):
            raise EngineRequestError("batched prompts are not supported; send one prompt", "prompt")
        else:
            raise EngineRequestError("'prompt' must be a string or a list of token ids", "prompt")
        return self._prepare(checked, prompt_ids, "prompt")

    async def _submit(self, prepared: _Prepared, prompt_param: str) -> RequestStream:
        try:
            return await self.async_engine.add_request(
                prepared.prompt_ids,
                prepared.params,
                stop=prepared.stop,
                cache_salt=prepared.cache_salt,
            )
        except ValueError as e:  # the engine's own validation (e.g. ids out of vocab)
            raise EngineRequestError(str(e), prompt_param) from e

    # -- chat completions ------------------------------------------------------------------

    async def chat_completion_stream(
        self, body: dict, *, tenant: str | None = None
    ) -> AsyncIterator[dict]:
        """Yield `chat.completion.chunk` dicts; closing the iterator aborts the request."""
        prepared = self._prepare_chat(body, tenant)
        stream = await self._submit(prepared, "messages")
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
        }
        if prepared.include_usage:
            base["usage"] = None

        def chunk(delta: dict, finish_reason: str | None = None) -> dict:
            return {
                **base,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }

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
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "logprobs": None,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "finish_reason": _finish_reason(last.finish_reason if last else None),
                }
            ],
            "usage": _usage(last, len(prepared.prompt_ids)),
        }

    # -- legacy completions ----------------------------------------------------------------

    async def completion_stream(
        self, body: dict, *, tenant: str | None = None
    ) -> AsyncIterator[dict]:
        """Yield `text_completion` chunk dicts; closing the iterator aborts the request."""
        prepared = self._prepare_completion(body, tenant)
        stream = await self._submit(prepared, "prompt")
        base = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
        }
        if prepared.include_usage:
            base["usage"] = None

        def chunk(text: str, finish_reason: str | None = None) -> dict:
            return {
                **base,
                "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
                ],
            }

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
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": _finish_reason(last.finish_reason if last else None),
                }
            ],
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
