"""Structural guarantees behind the performance targets, checked without timing:
one forward per step for all streams, cached prefixes never recomputed, and
decoders never skipped while a long prompt is chunked in."""

from __future__ import annotations

import pytest
import torch

from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams
from tests.engine.engines import generate, make_llm

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class ForwardRecorder:
    """Wraps the model's forward to record how many tokens each call computed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls: list[int] = []
        model = engine.model_runner.model
        original = model.forward

        def recording_forward(input_ids, *args, **kwargs):
            self.calls.append(int(input_ids.shape[0]))
            return original(input_ids, *args, **kwargs)

        model.forward = recording_forward


def test_sixteen_streams_decode_in_one_forward_per_step(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder)
    for i in range(16):
        engine.add_request(f"s{i}", helpers.random_prompt(5 + i, seed=i), GREEDY)
    engine.step()  # all 16 prompts in one forward
    recorder = ForwardRecorder(engine)
    for _ in range(5):
        outputs = engine.step()
        assert sorted(o.request_id for o in outputs) == sorted(f"s{i}" for i in range(16))
    assert recorder.calls == [16] * 5


def test_cached_prefix_is_not_recomputed(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder)
    shared = helpers.random_prompt(96, seed=1)
    generate(engine, [[*shared, 7]], GREEDY)
    recorder = ForwardRecorder(engine)
    engine.add_request("warm", [*shared, 8, 9, 10], GREEDY)
    first = engine.step()
    assert first[0].num_cached_tokens == 96
    assert recorder.calls == [3]  # only the three new tokens ran through the model


def test_long_prompt_never_skips_a_decoder(checkpoint, helpers):
    folder, hf_model = checkpoint("qwen3")
    engine = make_llm(folder, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    decoders = [f"d{i}" for i in range(8)]
    for i, request_id in enumerate(decoders):
        engine.add_request(request_id, helpers.random_prompt(2, seed=10 + i), params)
    engine.step()
    long_prompt = helpers.random_prompt(120, seed=99)
    engine.add_request(
        "long", long_prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    recorder = ForwardRecorder(engine)
    steps_until_first_token = 0
    long_tokens = []
    for _ in range(40):
        outputs = engine.step()
        steps_until_first_token += 1
        assert {o.request_id for o in outputs} >= set(decoders)  # every decoder got its token
        long_tokens += [t for o in outputs if o.request_id == "long" for t in o.new_token_ids]
        if long_tokens:
            break
    assert max(recorder.calls) <= 16
    assert steps_until_first_token == 15  # 120 tokens at 8 per step beside 8 decodes
    assert long_tokens == helpers.reference_greedy(hf_model, long_prompt, 1)


def test_hit_on_blocks_a_running_request_still_uses(checkpoint, helpers):
    folder, hf_model = checkpoint("qwen2")
    engine = make_llm(folder)
    shared = helpers.random_prompt(40, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("first", [*shared, 3], params)
    engine.step()
    engine.step()
    engine.add_request("second", [*shared, 4, 4], params)
    tokens = {"first": [], "second": []}
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert cached["second"] == 40
    assert tokens["second"] == helpers.reference_greedy(hf_model, [*shared, 4, 4], 12)
    assert len(tokens["first"]) == 10  # two tokens came before this loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_tracks_cpu_float32(checkpoint, helpers):
    folder, hf_model = checkpoint("llama3")
    prompt = helpers.random_prompt(50, seed=123)
    engine = make_llm(folder, device="cuda", capture_logits=True)
    assert engine.dtype == torch.bfloat16
    generate(engine, [prompt], SamplingParams(max_tokens=1, temperature=0))
    logits = next(iter(engine.captured_logits.values()))[0][1]
    reference = helpers.reference_logits(hf_model, prompt)
    assert torch.allclose(logits, reference, atol=0.3)
