"""Pulled KV enters the decode engine's pool a bounded slice per step.

With IMPORT_BYTES_PER_STEP set to one block, a 10-block import takes 10 steps: requests
already decoding get a token at every one of them, the importing request is in no batch until
its copy is complete, nothing else can hit a block before its KV is in place, and an abort or
a pool that runs short mid-import leaves every pool full and every output exact.
"""

from __future__ import annotations

import pytest

from engine_backend import llm_engine
from engine_backend.pd.kv_blocks import KVBlocks
from engine_backend.sampling import SamplingParams
from engine_backend.sequence import SequenceStatus
from tests.engine.engines import make_llm
from tests.engine_pd.test_pd_engine import (
    BLOCK,
    GREEDY,
    assert_pool_full,
    prefill_and_export,
    prompt_of,
    run,
)

DECODER = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)


@pytest.fixture
def one_block_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_engine, "IMPORT_BYTES_PER_STEP", 1)  # at least one block a step


def pulled(pd_model_dir: str, prompt: list[int]) -> KVBlocks:
    prefill = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    (kv,) = prefill_and_export(prefill, [prompt])
    assert kv is not None
    assert_pool_full(prefill)
    return kv


def reference(pd_model_dir: str, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    colocated = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    results = run(colocated, [(p, params, {}) for p, params in requests])
    assert_pool_full(colocated)
    return [r["tokens"] for r in results]


def test_an_import_goes_one_slice_per_step_and_decoders_never_skip_a_step(
    pd_model_dir: str, one_block_per_step: None
) -> None:
    prompt = prompt_of(41)  # 10 transferable blocks
    kv = pulled(pd_model_dir, prompt)
    expected = reference(pd_model_dir, [(prompt_of(9, seed=5), DECODER), (prompt, GREEDY)])
    decode = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    decode.add_request("decoder", prompt_of(9, seed=5), DECODER)
    tokens: dict[str, list[int]] = {"decoder": [], "pd": []}
    tokens["decoder"] += decode.step()[0].new_token_ids  # its prefill step

    assert decode.add_request("pd", prompt, GREEDY, kv_import=kv) == 40
    seq = decode.requests["pd"]
    assert seq.status is SequenceStatus.IMPORTING and len(seq.pinned_blocks) == 10
    for filled in range(1, 11):
        outputs = {out.request_id: out for out in decode.step()}
        for request_id, out in outputs.items():
            tokens[request_id] += out.new_token_ids
        if filled < 10:  # the decoder goes on; the import is in no batch until complete
            assert list(outputs) == ["decoder"]
            assert seq.status is SequenceStatus.IMPORTING
            # Only the blocks whose KV is in place are findable in the prefix cache.
            assert len(decode.block_manager.find_cached_prefix(seq)) == filled
    assert list(outputs) == ["decoder", "pd"], "admitted in the step its copy completed"
    assert seq.status is SequenceStatus.RUNNING
    finished: dict[str, int] = {}
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.num_cached_tokens
    assert [tokens["decoder"], tokens["pd"]] == expected
    assert finished["pd"] == 40, "every pulled token was a hit; none went through a prefill"
    assert_pool_full(decode)


def test_a_request_for_the_same_prompt_never_hits_a_block_still_being_filled(
    pd_model_dir: str, one_block_per_step: None
) -> None:
    prompt = prompt_of(41)
    kv = pulled(pd_model_dir, prompt)
    (expected,) = reference(pd_model_dir, [(prompt, GREEDY)])
    decode = make_llm(pd_model_dir, num_blocks=96, block_size=BLOCK)
    decode.add_request("pd", prompt, GREEDY, kv_import=kv)
    decode.step()
    decode.step()  # two of ten blocks in place
    decode.add_request("local", prompt, GREEDY)
    tokens: dict[str, list[int]] = {"pd": [], "local": []}
    cached: dict[str, int] = {}
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert tokens == {"pd": expected, "local": expected}
    # Admitted in the next step, after its slice: three blocks in place, seven not yet named.
    assert cached == {"pd": 40, "local": 3 * BLOCK}
    assert_pool_full(decode)


def test_an_abort_while_importing_frees_every_block(
    pd_model_dir: str, one_block_per_step: None
) -> None:
    prompt = prompt_of(41)
    kv = pulled(pd_model_dir, prompt)
    decode = make_llm(pd_model_dir, num_blocks=64, block_size=BLOCK)
    decode.add_request("pd", prompt, GREEDY, kv_import=kv)
    for _ in range(3):
        assert decode.step() == []
    decode.abort_request("pd")
    (out,) = decode.step()
    assert out.finished and out.finish_reason == "abort"
    assert not decode.has_unfinished()
    assert not decode.scheduler.importing
    assert_pool_full(decode)
    # The three blocks filled before the abort stay cached and are real hits.
    (again,) = run(decode, [(prompt, GREEDY, {})])
    assert again["cached"] == 3 * BLOCK
    assert again["tokens"] == reference(pd_model_dir, [(prompt, GREEDY)])[0]
    assert_pool_full(decode)


def test_an_import_yields_its_pins_to_a_running_sequence_that_needs_room(
    pd_model_dir: str, one_block_per_step: None
) -> None:
    prompt = prompt_of(41)
    kv = pulled(pd_model_dir, prompt)
    blocker = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    requests = [(prompt_of(40, seed=9), blocker), (prompt, GREEDY)]
    expected = reference(pd_model_dir, requests)
    # The running one grows from 10 to 18 blocks; with 10 pinned for the import, 21 is too
    # few within a few steps, long before the ten-step import is done.
    decode = make_llm(pd_model_dir, num_blocks=21, block_size=BLOCK, max_num_seqs=1)
    decode.add_request("blocker", *requests[0])
    tokens: dict[str, list[int]] = {"blocker": [], "pd": []}
    tokens["blocker"] += decode.step()[0].new_token_ids
    decode.add_request("pd", prompt, GREEDY, kv_import=kv)
    seq = decode.requests["pd"]
    while seq.status is SequenceStatus.IMPORTING:
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert seq.pinned_blocks == [] and seq.status is SequenceStatus.WAITING
    assert 0 < len(decode.block_manager.find_cached_prefix(seq)) < 10, "cut short"
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens["blocker"], tokens["pd"]] == expected
    assert decode.scheduler.num_preemptions == 0
    assert_pool_full(decode)
