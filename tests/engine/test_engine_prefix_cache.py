"""Prefix caching seen from the engine: hits reported, eviction safe, tenants isolated."""

from __future__ import annotations

from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams
from tests.engine.engines import make_llm

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def run_one(
    engine: LLMEngine, request_id: str, prompt: list[int], salt: str | None = None
) -> tuple[list[int], int]:
    engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
    tokens: list[int] = []
    cached = -1
    for _ in range(100):
        for out in engine.step():
            assert out.request_id == request_id
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
            if out.finished:
                return tokens, cached
    raise AssertionError("request did not finish")


def test_hits_are_reported_and_outputs_unchanged(checkpoint, helpers):
    folder, hf_model = checkpoint("qwen2")
    engine = make_llm(folder)
    system = helpers.random_prompt(40, seed=21)
    cold_tokens, cold_cached = run_one(engine, "a", [*system, 5, 6, 7])
    warm_tokens, warm_cached = run_one(engine, "b", [*system, 5, 6, 7])
    assert (
        cold_cached == 0 and warm_cached == 40
    )  # 43 tokens: 10 full blocks, last token recomputed
    assert warm_tokens == cold_tokens == helpers.reference_greedy(hf_model, [*system, 5, 6, 7], 5)
    # Generated tokens are cached too: a follow-up turn hits beyond the prompt.
    follow_up = [*system, 5, 6, 7, *cold_tokens, 9, 9]
    _, follow_cached = run_one(engine, "c", follow_up)
    assert follow_cached == 44


def test_disabled_cache_reports_no_hits(checkpoint, helpers):
    folder, _ = checkpoint("qwen2")
    engine = make_llm(folder, enable_prefix_caching=False)
    prompt = helpers.random_prompt(30, seed=22)
    run_one(engine, "a", prompt)
    assert run_one(engine, "b", prompt)[1] == 0


def test_eviction_under_pressure_keeps_outputs_correct(checkpoint, helpers):
    folder, hf_model = checkpoint("llama3")
    engine = make_llm(folder, num_blocks=16)  # room for ~2 prompts' blocks
    distinct = [helpers.random_prompt(26, seed=30 + i) for i in range(6)]
    for round_ in range(2):
        for i, prompt in enumerate(distinct):
            tokens, cached = run_one(engine, f"r{round_}-{i}", prompt)
            assert tokens == helpers.reference_greedy(hf_model, prompt, 5)
            if round_ == 1:
                assert cached == 0  # six prompts cycled through a pool that holds two: all evicted
        assert engine.block_manager.num_free_blocks == 16
    # The most recent prompt is still cached.
    assert run_one(engine, "again", distinct[-1])[1] == 24


def test_cache_salt_isolates_tenants(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder)
    prompt = helpers.random_prompt(33, seed=40)
    assert run_one(engine, "a1", prompt, salt="tenant-a")[1] == 0
    assert run_one(engine, "b1", prompt, salt="tenant-b")[1] == 0
    assert run_one(engine, "none", prompt)[1] == 0
    assert run_one(engine, "a2", prompt, salt="tenant-a")[1] == 32
    assert run_one(engine, "b2", prompt, salt="tenant-b")[1] == 32


def test_lpm_admits_the_longest_cached_prefix_first(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, schedule_policy="lpm", max_num_seqs=1)
    warm = helpers.random_prompt(24, seed=50)
    run_one(engine, "prime", warm)
    engine.add_request("cold", helpers.random_prompt(24, seed=51), GREEDY)
    engine.add_request("warm", [*warm[:20], 3, 3, 3, 3], GREEDY)
    first = engine.step()
    assert [o.request_id for o in first] == ["warm"] and first[0].num_cached_tokens == 20


def test_reset_prefix_cache(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder)
    prompt = helpers.random_prompt(20, seed=60)
    run_one(engine, "a", prompt)
    engine.reset_prefix_cache()
    assert run_one(engine, "b", prompt)[1] == 0
