"""Tokenizer, chat template and incremental detokenizer for a Hugging Face model folder.

The engine works on token ids; this module is the only place that knows about text.
It reads `tokenizer.json` with the `tokenizers` library (no `transformers` at run time)
and renders the chat template from `tokenizer_config.json` with a sandboxed jinja2
environment, the same way Hugging Face does, so prompts are byte-identical to theirs.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens of prompt context kept in front of the output when detokenizing, so that
# tokenizers which drop a leading space at the start of a decode (SentencePiece) still
# produce the right first word.
DETOKENIZE_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (it called `raise_exception`)."""


class ChatTemplateRenderError(ChatTemplateError):
    """The template broke on the values it was given (a wrong type where it expected another):
    the request's fault, since a template is a function of the request alone."""


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are either a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & for HTML; chat templates want plain JSON.
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )


def _load_chat_template(model_dir: str, config: dict) -> str | None:
    """The default template: tokenizer_config's `chat_template` (a string or a named list),
    or a `chat_template.jinja` file next to it (newer Hugging Face layout)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


class Tokenizer:
    """Text <-> ids for one model folder, plus its chat template."""

    def __init__(self, model_dir: str) -> None:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(path)
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        config: dict = {}
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = _load_chat_template(model_dir, config)
        self._compiled_template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Raises ChatTemplateError when the model has no template or the template refuses
        the conversation (for example roles that do not alternate).
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if self._compiled_template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from e
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # any value the request supplied may break any template line
            raise ChatTemplateRenderError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        # The template writes special tokens (BOS included) as text; adding them again
        # would double the BOS, which is what Hugging Face also avoids here.
        text = self.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Byte-level tokenizers split one character across several tokens; decoding such a
    partial tail yields U+FFFD. The tail is held back until the character completes, so a
    client never sees half a character. Each step decodes only a short window of ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list((prompt_token_ids or [])[-DETOKENIZE_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append new ids; return the text that is now complete (may be empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a sequence, return the held-back text that is complete.

        A stop or length cut can fall inside a character; its first bytes decode to U+FFFD,
        which is dropped here (as vLLM drops them) so no answer ends in a replacement
        character, streamed or whole. A literal U+FFFD the model wrote as its very last
        character looks the same in decoded text and is dropped too."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        tail = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        return tail.rstrip(REPLACEMENT_CHAR)
