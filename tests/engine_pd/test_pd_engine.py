"""PD at the engine level: two LLMEngines in one process, KV moved by export_kv/kv_import.

Outputs must equal a colocated engine's, token for token, and every pool must be full again
once the requests and holds are gone.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine_backend.llm_engine import LLMEngine
from engine_backend.pd.holds import KVHoldLimitError
from engine_backend.pd.kv_blocks import KVBlocks
from engine_backend.sampling import SamplingParams
from tests.engine.engines import make_llm

BLOCK = 4
_ids = itertools.count()


def prompt_of(length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(1000 + length + seed)
    return torch.randint(3, 400, (length,), generator=generator).tolist()


def run(llm: LLMEngine, requests: list[tuple[list[int], SamplingParams, dict]]) -> list[dict]:
    """Add every request, step until all finish; per request: tokens, cached, imported, held."""
    results = []
    ids = []
    for prompt, params, options in requests:
        request_id = f"r{next(_ids)}"
        imported = llm.add_request(request_id, prompt, params, **options)
        ids.append(request_id)
        results.append({"tokens": [], "imported": imported})
    by_id = dict(zip(ids, results, strict=True))
    for _ in range(2000):
        if all("cached" in r for r in results):
            break
        for out in llm.step():
            result = by_id[out.request_id]
            result["tokens"].extend(out.new_token_ids)
            if out.finished:
                result["cached"] = out.num_cached_tokens
                result["held"] = out.held_block_ids
                result["reason"] = out.finish_reason
    assert all("cached" in r for r in results), "requests did not finish"
    return results


def assert_pool_full(*engines: LLMEngine) -> None:
    for llm in engines:
        assert not llm.kv_holds.holds and not llm.kv_holds.reserved
        bm = llm.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
        assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture
def engines(pd_model_dir: str):
    options = {"num_blocks": 96, "block_size": BLOCK, "max_num_batched_tokens": 256}
    prefill = make_llm(pd_model_dir, **options)
    decode = make_llm(pd_model_dir, **options)
    colocated = make_llm(pd_model_dir, **options)
    yield prefill, decode, colocated
    assert_pool_full(prefill, decode, colocated)


def prefill_and_export(prefill: LLMEngine, prompts: list[list[int]]) -> list[KVBlocks | None]:
    """Step 1 and the side channel's read, for several prompts prefilled together."""
    ask = SamplingParams(max_tokens=1, ignore_eos=True)
    transfer_ids = [f"xfer-{next(_ids)}" for _ in prompts]
    holds = zip(prompts, transfer_ids, strict=True)
    results = run(prefill, [(p, ask, {"kv_hold_id": t}) for p, t in holds])
    exported = []
    for prompt, transfer_id, result in zip(prompts, transfer_ids, results, strict=True):
        assert len(result["held"]) == (len(prompt) - 1) // BLOCK
        out = prefill.export_kv(transfer_id)
        assert (out is None) == (not result["held"])
        if out is not None:
            assert out[0] == result["held"]
            assert prefill.export_kv(transfer_id) is None, "a transfer is served once"
        exported.append(out[1] if out else None)
    return exported


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
SEEDED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated_across_lengths(engines, params) -> None:
    prefill, decode, colocated = engines
    # Shorter than a block, one block, exact multiples, one past, long; all at once.
    prompts = [prompt_of(n) for n in (3, 4, 8, 9, 16, 23, 97)]
    expected = [r["tokens"] for r in run(colocated, [(p, params, {}) for p in prompts])]
    pulled = prefill_and_export(prefill, prompts)
    requests = [
        (p, params, {"kv_import": kv} if kv is not None else {})
        for p, kv in zip(prompts, pulled, strict=True)
    ]
    results = run(decode, requests)
    assert [r["tokens"] for r in results] == expected
    for prompt, result in zip(prompts, results, strict=True):
        usable = (len(prompt) - 1) // BLOCK * BLOCK
        assert result["imported"] == usable
        # Every pulled token counts as cached: none of them went through a prefill step.
        assert result["cached"] == usable


def test_pulled_blocks_serve_the_next_turn_from_the_local_prefix_cache(engines) -> None:
    prefill, decode, colocated = engines
    first = prompt_of(30)
    (kv,) = prefill_and_export(prefill, [first])
    (turn1,) = run(decode, [(first, GREEDY, {"kv_import": kv})])
    second = first + turn1["tokens"] + prompt_of(7, seed=1)
    (turn2,) = run(decode, [(second, GREEDY, {})])
    (reference,) = run(colocated, [(second, GREEDY, {})])
    assert turn2["tokens"] == reference["tokens"]
    # The pulled blocks and the ones the decode computed itself are both local hits now.
    assert turn2["cached"] >= (len(first) + len(turn1["tokens"]) - 1) // BLOCK * BLOCK - BLOCK
    assert turn2["cached"] > 28


def test_pulled_kv_is_keyed_by_the_decode_requests_own_salt(engines) -> None:
    prefill, decode, _ = engines
    prompt = prompt_of(21)
    (kv,) = prefill_and_export(prefill, [prompt])
    run(decode, [(prompt, GREEDY, {"kv_import": kv, "cache_salt": "tenant-a"})])
    other, same = run(decode, [(prompt, GREEDY, {"cache_salt": "tenant-b"})]) + run(
        decode, [(prompt, GREEDY, {"cache_salt": "tenant-a"})]
    )
    assert other["cached"] == 0
    assert same["cached"] == 20


def test_kv_for_other_tokens_is_refused(engines) -> None:
    prefill, decode, colocated = engines
    prompt = prompt_of(17)
    (kv,) = prefill_and_export(prefill, [prompt])
    assert kv is not None
    tampered = KVBlocks(list(kv.token_ids), kv.kv)
    tampered.token_ids[5] += 1
    (reference,) = run(colocated, [(prompt, GREEDY, {})])
    (result,) = run(decode, [(prompt, GREEDY, {"kv_import": tampered})])
    assert result["imported"] == 0 and result["cached"] == 0
    assert result["tokens"] == reference["tokens"]
    # KV pulled for another prompt is refused for this one too.
    (foreign,) = prefill_and_export(prefill, [prompt_of(17, seed=3)])
    (result,) = run(decode, [(prompt, GREEDY, {"kv_import": foreign})])
    assert result["imported"] == 0 and result["tokens"] == reference["tokens"]


def test_held_blocks_are_bounded_and_reservations_end_with_their_request(engines) -> None:
    prefill, _, _ = engines
    prefill.kv_holds.max_blocks = 6
    prefill.add_request("a", prompt_of(21), SamplingParams(max_tokens=1), kv_hold_id="t-a")
    assert prefill.kv_holds.num_reserved_blocks == 5
    with pytest.raises(KVHoldLimitError):
        prefill.add_request("b", prompt_of(9), SamplingParams(max_tokens=1), kv_hold_id="t-b")
    assert "b" not in prefill.requests
    prefill.abort_request("a")
    assert prefill.kv_holds.num_reserved_blocks == 0
    prefill.step()  # delivers the abort
    prefill.add_request("c", prompt_of(9), SamplingParams(max_tokens=1), kv_hold_id="t-c")
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.kv_holds.num_held_blocks == 2
    assert prefill.export_kv("t-c") is not None


def test_a_hold_nobody_pulls_is_freed_at_its_deadline(engines) -> None:
    prefill, _, _ = engines
    now = [100.0]
    prefill.kv_holds.clock = lambda: now[0]
    prefill.kv_holds.hold_s = 5.0
    (result,) = run(prefill, [(prompt_of(33), SamplingParams(max_tokens=1), {"kv_hold_id": "t"})])
    assert len(result["held"]) == 8
    bm = prefill.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks - 8
    now[0] += 4.9
    assert prefill.expire_kv_holds() == 0
    now[0] += 0.2
    assert prefill.expire_kv_holds() == 1
    assert bm.num_free_blocks == bm.num_total_blocks
    assert prefill.export_kv("t") is None


def test_imported_blocks_stay_pinned_until_admission(pd_model_dir: str) -> None:
    """A pulled request queued behind others keeps its blocks while they churn the pool."""
    prefill = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    decode = make_llm(pd_model_dir, num_blocks=32, block_size=BLOCK, max_num_seqs=1)
    long_prompt = prompt_of(41)
    (kv,) = prefill_and_export(prefill, [long_prompt])
    blocker = SamplingParams(max_tokens=30, ignore_eos=True)
    results = run(
        decode,
        [
            (prompt_of(40, seed=8), blocker, {}),
            (prompt_of(40, seed=9), blocker, {}),
            (long_prompt, GREEDY, {"kv_import": kv}),
        ],
    )
    assert results[2]["imported"] == 40 and results[2]["cached"] == 40
    assert_pool_full(prefill, decode)


def test_pins_yield_to_a_running_sequence_that_needs_room(pd_model_dir: str) -> None:
    prefill = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    decode = make_llm(pd_model_dir, num_blocks=24, block_size=BLOCK, max_num_seqs=1)
    colocated = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    long_prompt = prompt_of(41)
    (kv,) = prefill_and_export(prefill, [long_prompt])
    # 18 blocks for the running one plus 10 pinned for the waiting one: more than 24.
    blocker = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = [(prompt_of(40, seed=9), blocker, {}), (long_prompt, GREEDY, {})]
    expected = [r["tokens"] for r in run(colocated, requests)]
    requests[1] = (long_prompt, GREEDY, {"kv_import": kv})
    results = run(decode, requests)
    assert results[1]["imported"] == 40
    assert [r["tokens"] for r in results] == expected
    assert decode.scheduler.num_preemptions == 0
    assert_pool_full(prefill, decode, colocated)


def test_no_room_for_the_pull_means_a_local_prefill(pd_model_dir: str) -> None:
    prefill = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    decode = make_llm(pd_model_dir, num_blocks=14, block_size=BLOCK)
    colocated = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    prompt = prompt_of(45)
    (kv,) = prefill_and_export(prefill, [prompt])
    decode.add_request("busy", prompt_of(20, seed=4), SamplingParams(max_tokens=2))
    decode.step()  # the busy request holds 5 of 14 blocks; the pull needs 11
    imported = decode.add_request("pd", prompt, GREEDY, kv_import=kv)
    assert imported == 0
    tokens: list[int] = []
    while decode.has_unfinished():
        for out in decode.step():
            if out.request_id == "pd":
                tokens += out.new_token_ids
    assert tokens == run(colocated, [(prompt, GREEDY, {})])[0]["tokens"]
    assert_pool_full(prefill, decode, colocated)
