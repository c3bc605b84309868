"""A length or stop cut inside a multi-byte character never reaches the client as U+FFFD.

The checkpoint is the tiny random one with its weights rewritten into a bigram chain: its
attention and MLP write nothing (o_proj and down_proj are zero), the embeddings of the
chain's tokens are orthogonal, and lm_head maps each to the next. Greedy decoding after the
chat prompt therefore writes the bytes of CJK_TEXT one token at a time and then the end of
sequence token, so every `max_tokens` from 1 on cuts at a known byte, and the last one is a
stop in the middle of the emoji. Served by the engine's own OpenAI server over loopback.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import uvicorn
from safetensors.torch import load_file, save_file

from bench.harness import free_port
from engine_backend import LocalEngine
from engine_backend.server import create_app
from engine_backend.tokenizer import Tokenizer
from tests.support.clients import sdk_client
from tests.support.tiny_model import tiny_spec, write_tiny_model

# Every byte distinct, so a bigram chain over byte tokens is a function. 3 + 3 + 2 bytes of
# complete characters, then the first three of the four bytes of an emoji.
CJK_BYTES = "中文é😀".encode()[:-1]
PROMPT = "请用中文回答"
MESSAGES = [{"role": "user", "content": PROMPT}]


def _write_chain_model(folder: str, tokenizer: Tokenizer) -> list[int]:
    """Rewrite the weights so the prompt's last token starts the chain; the chain's ids."""
    chain = tokenizer.encode(CJK_BYTES.decode("utf-8", "replace").rstrip("\ufffd"))
    chain += tokenizer.encode("😀")[:3]
    start = tokenizer.encode_chat(MESSAGES)[-1]
    eos = tokenizer.eos_token_id
    assert eos is not None and len(chain) == len(CJK_BYTES)
    order = [start, *chain]
    assert len(set(order)) == len(order) and eos not in order
    path = f"{folder}/model.safetensors"
    weights = load_file(path)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    assert len(order) <= hidden
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    head.zero_()
    for position, (token, successor) in enumerate(zip(order, [*chain, eos], strict=True)):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(position), hidden).float()
        head[successor, position] = 10.0
    save_file(weights, path, metadata={"format": "pt"})
    return chain


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_model(tmp_path_factory, "chain", tiny_spec(seed=11))
    chain = _write_chain_model(folder, Tokenizer(folder))
    local_engine = LocalEngine.from_model(folder, num_blocks=64, max_num_batched_tokens=256)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(local_engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "server did not start"
    yield f"http://127.0.0.1:{port}", chain
    server.should_exit = True
    thread.join(15)
    assert not thread.is_alive()


@pytest.mark.parametrize("max_tokens", range(1, len(CJK_BYTES) + 2))
def test_cut_inside_a_character_is_dropped_streamed_and_whole(served, max_tokens: int) -> None:
    url, _ = served
    kwargs = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=max_tokens)
    with sdk_client(url, timeout=30) as client:
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    stops = max_tokens > len(CJK_BYTES)  # the token after the chain is the end of sequence
    # The complete characters among the bytes written: an incomplete tail is dropped.
    expected = CJK_BYTES[:max_tokens].decode("utf-8", "ignore")
    assert whole.choices[0].message.content == expected
    assert "".join(streamed) == expected
    assert all("\ufffd" not in delta for delta in streamed)
    assert whole.choices[0].finish_reason == reasons[-1] == ("stop" if stops else "length")
    assert whole.usage.completion_tokens == min(max_tokens, len(CJK_BYTES) + 1)


def test_some_cuts_do_fall_inside_a_character() -> None:
    """The parametrisation above covers cuts inside each character, not only between them."""
    inside = [
        n
        for n in range(1, len(CJK_BYTES) + 1)
        if CJK_BYTES[:n].decode("utf-8", "ignore").encode() != CJK_BYTES[:n]
    ]
    assert inside == [1, 2, 4, 5, 7, 9, 10, 11]
