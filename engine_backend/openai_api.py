"""`LocalEngine`: OpenAI request dicts in, OpenAI response and chunk dicts out.

This is the one surface the gateway's `local` upstream and the standalone server call.
It turns a request into prompt ids (chat template or legacy prompt) and SamplingParams,
runs it on the EngineThread and shapes the outputs like OpenAI's (openai_response).
With a PD config (engine_backend.pd) it also takes vLLM's `kv_transfer_params`: a prefill
request's answer names the held KV, a decode request pulls that KV before it is queued.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine_backend import request_fields as fields
from engine_backend.engine_thread import EngineThread, RequestOutput, RequestStream
from engine_backend.llm_engine import LLMEngine
from engine_backend.openai_response import CHAT, Endpoint, ResponseBuilder
from engine_backend.pd import params as pd_params
from engine_backend.pd.node import PDConfig, PDNode
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
    model: str
    max_tokens: int | None
    max_param: str
    sampling: dict[str, Any]
    stop: list[str]
    include_usage: bool
    cache_salt: str | None
    pd_step: pd_params.RemoteDecode | pd_params.RemotePrefill | None = None


@dataclass
class _Prepared:
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    include_usage: bool
    cache_salt: str | None
    pd_step: pd_params.RemoteDecode | pd_params.RemotePrefill | None = None


class LocalEngine:
    """The bundled engine behind an OpenAI-shaped API (dicts, no HTTP)."""

    def __init__(
        self,
        llm: LLMEngine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        description: str,
        isolate_tenants: bool = False,
        default_max_tokens: int | None = None,
        pd: PDConfig | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.description = description
        self.isolate_tenants = isolate_tenants
        self.default_max_tokens = default_max_tokens
        self.max_model_len = llm.max_model_len
        self.created = int(time.time())
        self.thread = EngineThread(llm, tokenizer)
        # None: kv_transfer_params is ignored, as before PD existed (the gateway's local route).
        self.pd = PDNode(pd, self.thread) if pd is not None else None

    @classmethod
    def from_model(
        cls,
        model: str | None = None,
        *,
        demo: bool = False,
        isolate_tenants: bool = False,
        pd: PDConfig | None = None,
        **engine_options: Any,
    ) -> LocalEngine:
        """Load a model folder or Hugging Face id, or (model None, demo True) the demo.

        `engine_options` are EngineConfig fields; one given as None takes EngineConfig's
        default, so every caller (the standalone server, the gateway) shares one default.
        """
        from engine_backend.config import EngineConfig
        from engine_backend.demo import DEMO_DESCRIPTION, DEMO_MODEL_NAME, build_demo_model
        from engine_backend.hub import resolve_model

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
        given = {key: value for key, value in engine_options.items() if value is not None}
        llm = LLMEngine(EngineConfig(model=path, **given))
        return cls(
            llm,
            Tokenizer(path),
            model_name=name,
            description=description,
            isolate_tenants=isolate_tenants,
            default_max_tokens=default_max_tokens,
            pd=pd,
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
        self.thread.start()
        if self.pd is not None:
            await self.pd.start()

    async def aclose(self) -> None:
        if self.pd is not None:
            await self.pd.close()
        await asyncio.to_thread(self.thread.shutdown)

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
        pd_step = None
        if self.pd is not None:
            pd_step = pd_params.parse(body)
            if pd_step is not None:
                self.pd.check_role(pd_step)
            if isinstance(pd_step, pd_params.RemoteDecode) and body.get("stream") is True:
                raise EngineRequestError(
                    "kv_transfer_params.do_remote_decode needs 'stream': false",
                    pd_params.FIELD,
                )
        return _Checked(
            body,
            fields.model(body, self.model_name),
            max_tokens,
            max_param,
            sampling,
            fields.stop_strings(body),
            fields.include_usage(body),
            salt,
            pd_step,
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
        # A prefill for remote decode must end normally to hold its KV; its text is thrown
        # away by the router (the decode server applies the stop strings).
        stop = [] if isinstance(checked.pd_step, pd_params.RemoteDecode) else checked.stop
        return _Prepared(
            checked.model,
            prompt_ids,
            params,
            stop,
            checked.include_usage,
            checked.cache_salt,
            checked.pd_step,
        )

    def _prepare_request(self, endpoint: Endpoint, body: Any, tenant: str | None) -> _Prepared:
        checked = self._check(body, tenant)
        if endpoint is CHAT:
            prompt_ids = self._chat_prompt(checked.body)
        else:
            prompt_ids = self._completion_prompt(checked.body)
        return self._prepare(checked, prompt_ids, endpoint.prompt_param)

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = fields.chat_messages(body)
        tools = fields.tools(body)
        extra, generation_prompt = fields.template_kwargs(body)
        try:
            return self.tokenizer.encode_chat(
                messages, tools=tools, add_generation_prompt=generation_prompt, **extra
            )
        except ChatTemplateRenderError as e:
            param = "chat_template_kwargs" if extra else "tools" if tools else "messages"
            raise EngineRequestError(str(e), param) from e
        except ChatTemplateError as e:  # the template refused the conversation
            raise EngineRequestError(str(e), "messages") from e

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        if isinstance(prompt, list):
            raise EngineRequestError("batched prompts are not supported; send one prompt", "prompt")
        raise EngineRequestError("'prompt' must be a string or a list of token ids", "prompt")

    async def _submit(
        self, prepared: _Prepared, prompt_param: str, transfer_id: str | None = None
    ) -> RequestStream:
        """Queue the request; a PD decode step first pulls the prompt's KV (a failed pull
        leaves an ordinary request). KVHoldLimitError (a 503) passes through."""
        kv_import = None
        step = prepared.pd_step
        if self.pd is not None and isinstance(step, pd_params.RemotePrefill):
            kv_import = await self.pd.pull(step, prepared.prompt_ids)
        try:
            stream = await self.thread.add_request(
                prepared.prompt_ids,
                prepared.params,
                stop=prepared.stop,
                cache_salt=prepared.cache_salt,
                kv_hold_id=transfer_id,
                kv_import=kv_import,
            )
        except ValueError as e:  # the engine's own validation (e.g. ids out of vocab)
            raise EngineRequestError(str(e), prompt_param) from e
        if self.pd is not None and kv_import is not None:
            self.pd.pulls.tokens += stream.num_imported_tokens
        return stream

    # -- responses -------------------------------------------------------------------------

    async def stream(
        self, body: dict, *, endpoint: Endpoint = CHAT, tenant: str | None = None
    ) -> AsyncGenerator[dict, None]:
        """Yield the endpoint's chunk dicts; closing the iterator aborts the request. A bad
        request raises EngineRequestError on the first `__anext__`, before any chunk."""
        prepared = self._prepare_request(endpoint, body, tenant)
        request = await self._submit(prepared, endpoint.prompt_param)
        response = ResponseBuilder(
            endpoint,
            prepared.model,
            len(prepared.prompt_ids),
            include_usage=prepared.include_usage,
        )
        last: RequestOutput | None = None
        try:
            for chunk in response.opening_chunks():
                yield chunk
            async for out in request:
                last = out
                if out.text:
                    yield response.text_chunk(out.text)
                if out.finished:
                    yield response.finish_chunk(out)
            if prepared.include_usage:
                yield response.usage_chunk(last)
        finally:
            request.abort()

    async def complete(
        self, body: dict, *, endpoint: Endpoint = CHAT, tenant: str | None = None
    ) -> dict:
        """The endpoint's whole response dict."""
        prepared = self._prepare_request(endpoint, body, tenant)
        transfer_id = None
        if self.pd is not None and isinstance(prepared.pd_step, pd_params.RemoteDecode):
            transfer_id = self.pd.new_transfer_id()
        request = await self._submit(prepared, endpoint.prompt_param, transfer_id)
        parts: list[str] = []
        last: RequestOutput | None = None
        try:
            async for out in request:
                parts.append(out.text)
                last = out
        finally:
            request.abort()
        response = ResponseBuilder(endpoint, prepared.model, len(prepared.prompt_ids))
        whole = response.whole("".join(parts), last)
        if self.pd is not None and transfer_id is not None:
            held = last.held_block_ids if last is not None else None
            whole[pd_params.FIELD] = self.pd.answer(transfer_id, held)
        return whole
