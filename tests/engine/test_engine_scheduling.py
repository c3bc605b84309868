"""Scheduling under pressure: token budgets, decode priority, preemption, abort, leaks."""

from __future__ import annotations

import pytest

from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams
from tests.engine.engines import generate, make_llm

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle; returns request id -> [tokens, finish_reason]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            entry = results.setdefault(out.request_id, [[], None])
            entry[0].extend(out.new_token_ids)
            if out.finished:
                entry[1] = out.finish_reason
    raise AssertionError("engine did not finish")


def prompts(helpers, count: int, seed: int = 100) -> list[list[int]]:
    return [helpers.random_prompt(5 + (7 * i) % 23, seed=seed + i) for i in range(count)]


def test_step_respects_token_budget_and_runs_decodes_first(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, max_num_batched_tokens=16)
    for i in range(3):
        engine.add_request(f"short-{i}", helpers.random_prompt(4, seed=i), GREEDY)
    engine.step()  # 12 prompt tokens: all three admitted, each samples its first token
    engine.add_request("long", helpers.random_prompt(60, seed=9), GREEDY)
    for chunk in (13, 13, 13, 13, 8):  # 60 prompt tokens beside 3 decodes, 16 per step
        batch = engine.scheduler.schedule()
        assert batch.num_tokens <= 16
        assert [s.request_id for s in batch.decodes] == ["short-0", "short-1", "short-2"]
        assert [(s.request_id, n) for s, n in batch.prefills] == [("long", chunk)]
        result = engine.model_runner.execute(batch.decodes, batch.prefills)
        engine.scheduler.advance(batch)
        tokens = engine.sampler.sample(
            result.logits, [s.params for s in result.sampled], [None] * len(result.sampled)
        )
        for s, token in zip(result.sampled, tokens, strict=False):
            s.token_ids.append(token)
        assert [s.request_id for s in result.sampled][3:] == (["long"] if chunk == 8 else [])


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_tiny_pool_preempts_yet_every_request_matches_a_big_pool(checkpoint, helpers, policy):
    folder, _ = checkpoint("qwen3")
    batch = prompts(helpers, 10)
    big = make_llm(folder)
    expected = generate(big, batch, GREEDY)
    # 12 blocks of 4 = 48 tokens; each request needs up to 8 blocks by its end.
    small = make_llm(folder, num_blocks=12, max_num_batched_tokens=32, schedule_policy=policy)
    assert small.max_model_len == 48
    assert generate(small, batch, GREEDY) == expected
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_total_blocks


def test_preemption_without_prefix_cache_recomputes_exactly(checkpoint, helpers):
    folder, _ = checkpoint("llama3")
    batch = prompts(helpers, 8, seed=200)
    expected = generate(make_llm(folder), batch, GREEDY)
    small = make_llm(folder, num_blocks=10, enable_prefix_caching=False, max_num_batched_tokens=8)
    assert generate(small, batch, GREEDY) == expected
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == 10


def test_abort_frees_blocks_at_once_and_reports_on_next_step(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, num_blocks=32)
    engine.add_request("keep", helpers.random_prompt(10, seed=1), GREEDY)
    engine.add_request("drop", helpers.random_prompt(20, seed=2), GREEDY)
    engine.step()
    used_before = engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks
    engine.abort_request("drop")
    used_after = engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks
    assert used_before - used_after == 5  # its 20 computed prompt tokens, in blocks of 4
    engine.abort_request("drop")  # twice: ignored
    engine.abort_request("unknown")  # never existed: ignored
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "drop"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert aborted[0].new_token_ids == []
    results = drain(engine)
    assert "drop" not in results and results["keep"][1] == "length"
    assert engine.block_manager.num_free_blocks == 32


def test_abort_of_a_waiting_request(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, max_num_seqs=1)
    engine.add_request("first", helpers.random_prompt(8, seed=1), GREEDY)
    engine.add_request("queued", helpers.random_prompt(8, seed=2), GREEDY)
    first_token = engine.step()[0].new_token_ids
    assert [s.request_id for s in engine.scheduler.waiting] == ["queued"]
    engine.abort_request("queued")
    assert not engine.scheduler.waiting
    results = drain(engine)
    assert results["queued"] == [[], "abort"]
    assert len(first_token + results["first"][0]) == 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_random_aborts_under_pressure_never_leak_or_corrupt(checkpoint, helpers):
    folder, _ = checkpoint("mistral")
    batch = prompts(helpers, 12, seed=300)
    expected = generate(make_llm(folder), batch, GREEDY)
    engine = make_llm(folder, num_blocks=14, max_num_batched_tokens=20)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, GREEDY)
    doomed = {"r1", "r4", "r7", "r10"}
    results: dict[str, list] = {}
    for step in range(2000):
        if not engine.has_unfinished():
            break
        if step in (3, 9, 15, 40):
            engine.abort_request(sorted(doomed)[(3, 9, 15, 40).index(step)])
        for out in engine.step():
            entry = results.setdefault(out.request_id, [[], None])
            entry[0].extend(out.new_token_ids)
            if out.finished:
                entry[1] = out.finish_reason
    assert not engine.has_unfinished()
    for i in range(len(batch)):
        tokens, reason = results[f"r{i}"]
        if f"r{i}" in doomed and reason == "abort":
            assert tokens == expected[i][: len(tokens)]
        else:
            assert (tokens, reason) == (expected[i], "length")
    assert engine.block_manager.num_free_blocks == 14


def test_max_num_seqs_caps_running(checkpoint, helpers):
    folder, _ = checkpoint("llama")
    engine = make_llm(folder, max_num_seqs=3)
    for i in range(6):
        engine.add_request(f"r{i}", helpers.random_prompt(5, seed=i), GREEDY)
    for _ in range(10):
        engine.step()
        assert len(engine.scheduler.running) <= 3
    assert len(drain(engine)) == 6
