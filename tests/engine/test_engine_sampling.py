"""The sampler's filters and draws, and the engine's stop and validation rules."""

from __future__ import annotations

import pytest
import torch

from engine_backend.config import EngineConfig
from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import Sampler, SamplingParams, filter_logits


def kept(logits: list[float], temperature=1.0, top_k=0, top_p=1.0) -> list[int]:
    out = filter_logits(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )
    return torch.nonzero(out[0] > float("-inf")).flatten().tolist()


def test_top_k_keeps_the_k_largest():
    assert kept([0.1, 3.0, 2.0, -1.0, 2.5], top_k=2) == [1, 4]
    assert kept([0.1, 3.0, 2.0], top_k=0) == [0, 1, 2]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().tolist()
    assert kept(logits, top_p=0.5) == [0]
    assert kept(logits, top_p=0.6) == [0, 1]
    assert kept(logits, top_p=0.81) == [0, 1, 2]
    assert kept(logits, top_p=0.01) == [0]


def test_temperature_scales_before_filtering():
    out = filter_logits(
        torch.tensor([[2.0, 4.0]]), torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0])
    )
    assert torch.allclose(out, torch.tensor([[1.0, 2.0]]))


def test_greedy_rows_take_the_argmax_and_random_rows_follow_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 5.0, 1.0], [1.0, 1.0, 1.0]]).log_softmax(-1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    counts = torch.zeros(3)
    for _ in range(600):
        first, second = sampler.sample(logits, params, [None, None])
        assert first == 1
        counts[second] += 1
    assert (counts > 150).all() and (counts < 250).all()  # uniform within ~4 sigma


def test_top_k_one_is_greedy_even_at_high_temperature():
    sampler = Sampler(torch.device("cpu"), seed=3)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    assert sampler.sample(logits, params, [None] * 4) == logits.argmax(1).tolist()


def test_seeded_requests_repeat_regardless_of_batch(checkpoint):
    folder, _ = checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    crowded = engine.generate([[11, 12], prompt, [13, 14, 15]], [other, seeded, other])[1]
    assert alone == crowded
    different_seed = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate([prompt], different_seed)[0] != alone


def test_stop_ids_eos_and_max_tokens(checkpoint, helpers):
    folder, hf_model = checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    assert engine.eos_token_ids == [2]  # from generation_config.json
    prompt = helpers.random_prompt(12, seed=70)
    expected = helpers.reference_greedy(hf_model, prompt, 8)
    stop_at = expected[3]
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at])
    )[0]
    assert out == expected[: expected.index(stop_at) + 1]

    engine.eos_token_ids = [stop_at]  # pretend the model's eos is that token
    assert engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0][-1] == stop_at
    ignored = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert ignored == expected

    engine.add_request("len", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outputs = [o for _ in range(10) for o in engine.step()]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[-1].num_prompt_tokens == 12


def test_add_request_validation(checkpoint):
    folder, _ = checkpoint("llama")
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=8, block_size=4))
    assert engine.max_model_len == 32  # capped by the pool, below max_position_embeddings
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [5] * 20, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [5, 256], SamplingParams())
    engine.add_request("a", [5] * 20, SamplingParams(max_tokens=12))
    with pytest.raises(ValueError, match="in flight"):
        engine.add_request("a", [5], SamplingParams())


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-1)
