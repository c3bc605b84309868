"""The sampler's filters and draws, and the engine's stop and validation rules."""

from __future__ import annotations

import pytest
import torch

from engine_backend.sampling import MAX_SEED, MIN_SEED, Sampler, SamplingParams, filter_logits
from tests.engine.engines import generate, make_llm


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
    engine = make_llm(folder, num_blocks=64)
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = generate(engine, [prompt], seeded)[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    crowded = generate(engine, [[11, 12], prompt, [13, 14, 15]], [other, seeded, other])[1]
    assert alone == crowded
    different_seed = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert generate(engine, [prompt], different_seed)[0] != alone


def test_stop_ids_eos_and_max_tokens(checkpoint, helpers):
    folder, hf_model = checkpoint("llama")
    engine = make_llm(folder, num_blocks=64)
    assert engine.eos_token_ids == [2]  # from generation_config.json
    prompt = helpers.random_prompt(12, seed=70)
    expected = helpers.reference_greedy(hf_model, prompt, 8)
    stop_at = expected[3]
    out = generate(
        engine, [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at])
    )[0]
    assert out == expected[: expected.index(stop_at) + 1]

    engine.eos_token_ids = [stop_at]  # pretend the model's eos is that token
    assert generate(engine, [prompt], SamplingParams(max_tokens=8, temperature=0))[0][-1] == stop_at
    ignored = generate(
        engine, [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert ignored == expected

    engine.add_request("len", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outputs = [o for _ in range(10) for o in engine.step()]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[-1].num_prompt_tokens == 12


def test_add_request_validation(checkpoint):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, num_blocks=8)
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


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(max_tokens=True),
        dict(max_tokens=2.0),
        dict(top_p=0.0),
        dict(top_p=float("nan")),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_k=2**63),
        dict(top_k=2**31),
        dict(top_k=True),
        dict(seed=2**64),
        dict(seed=-(2**63) - 1),
        dict(seed=1.5),
        dict(seed=False),
    ],
)
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_the_seed_bounds_are_what_torch_accepts():
    for seed in (MIN_SEED, MAX_SEED):
        SamplingParams(seed=seed)
        torch.Generator().manual_seed(seed)
    for seed in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(seed)


def test_a_tiny_temperature_is_greedy_not_nan():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(3, 50) * 20
    params = [SamplingParams(temperature=1e-30)] * 3
    assert sampler.sample(logits, params, [None] * 3) == logits.argmax(1).tolist()


def test_a_row_that_cannot_be_sampled_fails_its_request_alone(checkpoint):
    """A value no check foresaw (here a top_k past int64, set behind the params' back) breaks
    the batched draw; only its own request ends, with an error, and the others finish as if
    it had never been there."""
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, num_blocks=64)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    expected = generate(engine, prompts[:2], [greedy, seeded])
    poison = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    poison.top_k = 2**63
    for request_id, prompt, params in zip("abp", prompts, [greedy, seeded, poison], strict=False):
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {"a": [], "b": [], "p": []}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    (failed,) = outputs["p"]
    assert failed.finished and failed.finish_reason == "error" and failed.new_token_ids == []
    assert "sampling failed" in failed.error
    for request_id, want in zip("ab", expected, strict=False):
        assert [t for o in outputs[request_id] for t in o.new_token_ids] == want
        assert outputs[request_id][-1].finish_reason == "length"
        assert all(o.error is None for o in outputs[request_id])
    assert engine.requests == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    with pytest.raises(RuntimeError, match="prompt 1: sampling failed"):
        generate(engine, prompts[:2], [greedy, poison])
