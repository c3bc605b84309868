"""bench/smollm2_checkpoint.py: its tokenizer fills the model's vocabulary exactly, keeps
the chat tokens at SmolLM2's ids, encodes any text and decodes it back; its config is one
the engine reads as SmolLM2-135M's shape."""

from __future__ import annotations

from bench.smollm2_checkpoint import SHAPE, SPECIAL_TOKENS, build_tokenizer
from engine_backend.models.llama import DecoderArgs


def test_tokenizer_has_exactly_the_vocabulary_asked_for_and_round_trips_any_text() -> None:
    tokenizer = build_tokenizer(vocab_size=700)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 700
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    for text in ("Write a short poem about the sea.", "请用中文简单介绍一下长城的历史。"):
        ids = tokenizer.encode(text).ids
        assert max(ids) < 700
        assert tokenizer.decode(ids) == text
    # Learned merges: common text takes fewer tokens than bytes.
    assert len(tokenizer.encode("the sea").ids) < len(b"the sea")


def test_config_is_smollm2_135m_shape_for_the_engine() -> None:
    args = DecoderArgs.from_hf(SHAPE)
    assert (args.num_layers, args.hidden_size, args.intermediate_size) == (30, 576, 1536)
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (9, 3, 64)
    assert args.vocab_size == 49152 and args.tie_word_embeddings
    assert args.rope["rope_theta"] == 100000.0
