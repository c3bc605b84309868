"""A SmolLM2-135M-Instruct-shaped checkpoint with seeded random weights, built locally.

    python bench/smollm2_checkpoint.py              # prints the folder (written on first use)
    python bench/smollm2_checkpoint.py --margins    # also the greedy logit margins it gives

The engine benches compare the bundled engine with vLLM (or transformers) on a model of a
real model's exact shape, without downloading one: config.json has SmolLM2-135M-Instruct's
shapes (Llama architecture, 30 layers, 9 query and 3 kv heads of 64, tied embeddings,
rope_theta 100000, vocab 49152), the weights are normal draws from a fixed seed saved with
safetensors in Hugging Face's layout, and the tokenizer is a byte-level BPE trained here,
offline, to exactly the model's vocabulary (tokenizer.json, tokenizer_config.json with a
ChatML chat template). vLLM, transformers and the engine all load the folder as it is.

Why the init is not the usual 0.02 everywhere: with it, a random model's logits are nearly
flat (the top two differ by about a thousandth of their spread) and deep layers of uniform
attention wash the context out (an answer is 2-5 distinct tokens, the same whatever came
before), so a greedy comparison says little. Here the (tied) embeddings, which are also the
output head, are drawn at `EMBED_STD` (0.3), so the logits spread wide (median lead of the top
logit over the second about 1.4, far above where two float32 implementations round apart);
the query and key projections at `QK_STD` (0.1), so attention is sharp and the answer depends
on the whole prompt; and the final norm's weights are random signs, so the next token is not
an echo of the current one (its embedding would otherwise dominate the logits). On the
bench's five greedy prompts, `--margins` prints (transformers, float32, 64 tokens): 58-63
distinct tokens per answer, every answer changed by changing the prompt's first token,
smallest lead 0.0013-0.15. The folder is a cache: never committed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine_backend.demo import cached_model_folder, default_cache_dir, write_model_files

FORMAT_VERSION = 1
# The prompts whose greedy answers the engine benches compare (`bench/engine_vs_vllm.py`), and
# on which `--margins` shows this checkpoint makes such a comparison meaningful.
GREEDY_TEXTS = [
    "Write a short poem about the sea.",
    "Explain what a prefix cache does in two sentences.",
    "def fibonacci(n):",
    "List three facts about the moon.",
    "请用中文简单介绍一下长城的历史。",
]
VOCAB_SIZE = 49152
# SmolLM2's special tokens take the first ids, in its order.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
LAYER_STD = 0.02
QK_STD = 0.1
EMBED_STD = 0.3
SEED = 135

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}

# ChatML, as the Instruct model's conversations are framed (written here, not copied).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SEED_TEXT = (
    "The first token of an answer arrives once the model has read the whole prompt. "
    "Write a short poem about the sea. Explain what a prefix cache does in two sentences. "
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) "
    "List three facts about the moon. 0123456789 {}[]() Hello, world! How are you today? "
    "请用中文简单介绍一下长城的历史。 長城は古い。 Ça va très bien, merci."
)


def _training_lines(seed: int) -> list[str]:
    """The seed text, then seeded pseudo-words: enough distinct pairs for BPE to learn
    merges up to the full vocabulary in a few seconds."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiouy")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(2**18)]
    return [_SEED_TEXT] * 50 + [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]


def build_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = SEED) -> Tokenizer:
    """A byte-level BPE (every byte is a token, so any text encodes) with exactly
    `vocab_size` entries, the chat special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(seed), trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise RuntimeError(f"the BPE reached {size} tokens, not {vocab_size}")
    return tokenizer


def random_weights(embed_std: float = EMBED_STD, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (float32), drawn from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    q_out = SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    kv_out = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]

    def normal(std: float, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    signs = torch.randint(0, 2, (hidden,), generator=generator).float() * 2 - 1
    weights = {
        "model.embed_tokens.weight": normal(embed_std, VOCAB_SIZE, hidden),
        "model.norm.weight": signs,
    }
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(QK_STD, q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(QK_STD, kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(LAYER_STD, kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(LAYER_STD, hidden, q_out)
        weights[p + "mlp.gate_proj.weight"] = normal(LAYER_STD, inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(LAYER_STD, inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(LAYER_STD, hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return weights


def write_checkpoint(path: str, embed_std: float = EMBED_STD, seed: int = SEED) -> None:
    """A complete Hugging Face model folder at `path`."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(VOCAB_SIZE, seed)
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS)), strict=True):
        assert tokenizer.token_to_id(token) == expected, token
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    tokenizer_config = {
        "bos_token": IM_START,
        "eos_token": IM_END,
        "pad_token": IM_END,
        "unk_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": SHAPE["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    generation_config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    write_model_files(
        path, SHAPE, tokenizer_config, generation_config, random_weights(embed_std, seed)
    )


def build_checkpoint(
    cache_dir: str | None = None, embed_std: float = EMBED_STD, seed: int = SEED
) -> str:
    """The checkpoint's folder, written on first use under a name hashed from everything
    that shapes it (the engine's `cached_model_folder`, as for the demo model)."""
    return cached_model_folder(
        cache_dir or default_cache_dir(),
        "smollm2-135m-random",
        {"v": FORMAT_VERSION, "shape": SHAPE, "embed_std": embed_std, "seed": seed, "qk": QK_STD},
        lambda staging: write_checkpoint(staging, embed_std, seed),
    )


def greedy_margins(path: str, texts: list[str], max_tokens: int) -> list[dict]:
    """Per prompt, transformers' greedy run in float32: the smallest lead of the top logit
    over the second (absolute and relative to the logits' spread), and how many distinct
    tokens it wrote (one would mean the model only echoes)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text).ids])
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            leads, spreads = [], []
            for logits in out.logits:
                top2 = logits[0].topk(2).values
                leads.append(float(top2[0] - top2[1]))
                spreads.append(float(logits[0].std()))
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            # The same prompt with only its first token changed: does the answer notice?
            changed = ids.clone()
            changed[0, 0] = (changed[0, 0] + 1000) % VOCAB_SIZE
            other = model.generate(
                changed, max_new_tokens=max_tokens, do_sample=False, pad_token_id=2
            )[0, ids.shape[1] :].tolist()
            rows.append(
                {
                    "min_lead": min(leads),
                    "min_lead_over_std": min(a / b for a, b in zip(leads, spreads, strict=True)),
                    "median_lead": sorted(leads)[len(leads) // 2],
                    "distinct_tokens": len(set(tokens)),
                    "first_token_matters": other != tokens,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--embed-std", type=float, default=EMBED_STD)
    p.add_argument("--margins", action="store_true", help="greedy logit margins (transformers)")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    path = build_checkpoint(args.cache_dir, args.embed_std)
    print(path)
    if args.margins:
        print(
            f"{'min lead':>9} {'min lead/std':>13} {'median lead':>12} {'distinct':>9} "
            f"{'context':>8}"
        )
        for row in greedy_margins(path, GREEDY_TEXTS, args.tokens):
            print(
                f"{row['min_lead']:>9.4f} {row['min_lead_over_std']:>13.4f} "
                f"{row['median_lead']:>12.4f} {row['distinct_tokens']:>9} "
                f"{row['first_token_matters']!s:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
