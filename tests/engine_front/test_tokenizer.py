"""Tokenizer, chat template rendering and the incremental detokenizer."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine_backend.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

MULTI_BYTE = "héllo 你好, wörld 😀🚀 ok"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: str) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def stream_text(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_special_tokens_come_from_tokenizer_config(tok: Tokenizer) -> None:
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode([tok.bos_token_id], skip_special_tokens=False) == tok.bos_token
    assert tok.decode([tok.bos_token_id, *tok.encode("hi")]) == "hi"


def test_multi_byte_characters_are_never_split(tok: Tokenizer) -> None:
    ids = tok.encode(MULTI_BYTE)
    # The byte-level tokenizer really does split these characters across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream_text(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTI_BYTE


def test_partial_character_is_held_until_complete(tok: Tokenizer) -> None:
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) >= 2
    detok = IncrementalDetokenizer(tok)
    held = [detok.add([i]) for i in emoji_ids[:-1]]
    assert held == [""] * len(held)
    assert detok.add(emoji_ids[-1:]) == "😀"


def test_flush_drops_an_incomplete_tail_and_keeps_complete_text(tok: Tokenizer) -> None:
    a, e_acute, emoji = tok.encode("a"), tok.encode("é"), tok.encode("😀")
    detok = IncrementalDetokenizer(tok)
    assert detok.add(a) == "a"
    assert detok.add(emoji[:-1]) == ""
    assert tok.decode(emoji[:-1]).endswith("\ufffd")  # what the old flush sent
    assert detok.flush() == ""
    assert detok.flush() == ""
    # One add that completes a character and starts another holds both; flush keeps the first.
    detok = IncrementalDetokenizer(tok)
    assert detok.add(e_acute + emoji[:-1]) == ""
    assert detok.flush() == "é"


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_streamed_text_equals_full_decode(tiny_model_dir: str, text: str) -> None:
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(text)
    assert "".join(stream_text(tok, ids)) == tok.decode(ids)


def test_prompt_context_keeps_the_leading_space_of_sentencepiece_tokens(tmp_path) -> None:
    # Metaspace decoders drop the space of the first token in a decode; the detokenizer
    # decodes output together with the prompt's last tokens so " world" keeps its space.
    vocab = {"▁Hello": 0, "▁world": 1, "[UNK]": 2}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path))
    assert tok.decode([1]) == "world"
    assert "".join(stream_text(tok, [1], prompt=[0])) == " world"


def test_chat_template_renders_like_transformers(tiny_model_dir: str, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 你好"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "More <b>&</b>"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "<x> & é", "parameters": {"type": "object"}},
        }
    ]
    for kwargs in ({}, {"tools": tools}):
        ours = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        theirs = reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert ours == theirs
    ids = tok.encode_chat(messages)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_tools_are_plain_json_not_html_escaped(tok: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "lt", "description": "a < b & é"}}]
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools)
    assert '"description": "a < b & é"' in text


def test_template_raise_exception_becomes_chat_template_error(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def _write_tokenizer_folder(path, tiny_model_dir: str, config: dict) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(tiny_model_dir, "tokenizer.json"), encoding="utf-8") as f:
        (path / "tokenizer.json").write_text(f.read(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_named_templates_jinja_file_and_added_token_dicts(tmp_path, tiny_model_dir) -> None:
    named = tmp_path / "named"
    _write_tokenizer_folder(
        named,
        tiny_model_dir,
        {
            "bos_token": {"content": "<|begin_of_text|>", "special": True},
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
            ],
        },
    )
    tok = Tokenizer(str(named))
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|begin_of_text|>x"

    jinja_file = tmp_path / "jinja"
    _write_tokenizer_folder(jinja_file, tiny_model_dir, {})
    (jinja_file / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% endfor %}", encoding="utf-8"
    )
    tok = Tokenizer(str(jinja_file))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]"

    bare = tmp_path / "bare"
    _write_tokenizer_folder(bare, tiny_model_dir, {})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(str(bare)).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_cannot_reach_python_internals(tmp_path, tiny_model_dir) -> None:
    folder = tmp_path / "evil"
    _write_tokenizer_folder(
        folder,
        tiny_model_dir,
        {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"},
    )
    with pytest.raises(ChatTemplateError):
        Tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "x"}])
