"""PD between LocalEngines in one process, over the real TCP side channel."""

from __future__ import annotations

import copy

import pytest

from engine_backend import EngineRequestError, LocalEngine
from engine_backend.openai_response import COMPLETIONS
from engine_backend.pd.node import PDConfig
from tests.engine_pd.step1 import STEP1

OPTIONS = {"num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 256}


async def started(model_dir: str, pd: PDConfig | None) -> LocalEngine:
    engine = LocalEngine.from_model(model_dir, pd=pd, **OPTIONS)
    await engine.start()
    return engine


@pytest.fixture
async def trio(pd_model_dir: str):
    prefill = await started(pd_model_dir, PDConfig(role="prefill"))
    decode = await started(pd_model_dir, PDConfig(role="decode"))
    colocated = await started(pd_model_dir, None)
    yield prefill, decode, colocated
    for engine in (prefill, decode, colocated):
        status = await engine.thread.call(lambda llm: llm.block_manager.num_free_blocks)
        assert status == OPTIONS["num_blocks"], "a pool is not full again"
        await engine.aclose()


async def drop_holds(engine: LocalEngine) -> None:
    """End every hold now, as its timeout would (the pool check follows)."""
    await engine.thread.call(lambda llm: llm.kv_holds.release_all())


def request(text: str, **extra) -> dict:
    return {
        "model": "m",
        "prompt": text,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def disaggregated(prefill: LocalEngine, decode: LocalEngine, body: dict) -> tuple[str, dict]:
    """Steps 1-3 as a router runs them; returns the decode server's text and usage."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": STEP1}
    answer = await prefill.complete(first, endpoint=COMPLETIONS)
    params = answer["kv_transfer_params"]
    text, usage = "", {}
    second = {**body, "stream": True, "stream_options": {"include_usage": True}}
    second["kv_transfer_params"] = params
    async for chunk in decode.stream(second, endpoint=COMPLETIONS):
        if chunk["choices"]:
            text += chunk["choices"][0]["text"]
        if chunk.get("usage"):
            usage = chunk["usage"]
    return text, usage


LONG = " ".join(f"rule {i}: keep answers short and cite sources." for i in range(8))


async def test_prefill_answer_names_the_held_kv_in_vllms_fields(trio) -> None:
    prefill, _, _ = trio
    body = request(LONG, max_tokens=1, kv_transfer_params=STEP1)
    answer = await prefill.complete(body, endpoint=COMPLETIONS)
    params = answer["kv_transfer_params"]
    assert set(params) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
    }
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.pd.engine_id
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill.pd.kv_port
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == (prompt_tokens - 1) // 4
    # The sampled token comes back as usual (its text may be empty: a lone byte of a
    # character cut by max_tokens is dropped, not sent as U+FFFD).
    assert answer["usage"]["completion_tokens"] == 1
    assert "\ufffd" not in answer["choices"][0]["text"]
    assert prefill.llm.kv_holds.num_held_blocks == len(params["remote_block_ids"])
    await drop_holds(prefill)


@pytest.mark.parametrize("text", ["Hi", LONG, LONG + " " + LONG])
async def test_disaggregated_stream_equals_colocated(trio, text: str) -> None:
    prefill, decode, colocated = trio
    for extra in ({}, {"temperature": 0.9, "seed": 77}):
        body = request(text, **extra)
        expected = await colocated.complete(copy.deepcopy(body), endpoint=COMPLETIONS)
        got, usage = await disaggregated(prefill, decode, body)
        assert got == expected["choices"][0]["text"]
        assert usage["completion_tokens"] == 12
    assert decode.pd.pulls.failed == decode.pd.pulls.refused == 0


async def test_a_transfer_is_served_once_then_the_decode_computes_locally(trio) -> None:
    prefill, decode, colocated = trio
    body = request(LONG)
    first = {**body, "max_tokens": 1, "kv_transfer_params": STEP1}
    params = (await prefill.complete(first, endpoint=COMPLETIONS))["kv_transfer_params"]
    expected = (await colocated.complete(dict(body), endpoint=COMPLETIONS))["choices"][0]["text"]
    one = await decode.complete({**body, "kv_transfer_params": params}, endpoint=COMPLETIONS)
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Same params again on a fresh salt: the hold is gone, the pull fails, the answer stands.
    again = {**body, "kv_transfer_params": params, "cache_salt": "fresh"}
    two = await decode.complete(again, endpoint=COMPLETIONS)
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert one["choices"][0]["text"] == two["choices"][0]["text"] == expected
    assert decode.pd.pulls.ok == 1 and decode.pd.pulls.failed == 1


async def test_kv_of_another_model_or_host_is_refused(trio, other_model_dir: str) -> None:
    _, decode, colocated = trio
    other = await started(other_model_dir, PDConfig(role="prefill"))
    try:
        body = request(LONG)
        first = {**body, "max_tokens": 1, "kv_transfer_params": STEP1}
        params = (await other.complete(first, endpoint=COMPLETIONS))["kv_transfer_params"]
        expected = await colocated.complete(dict(body), endpoint=COMPLETIONS)
        got = await decode.complete({**body, "kv_transfer_params": params}, endpoint=COMPLETIONS)
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert decode.pd.pulls.refused == 1
        elsewhere = {**params, "remote_host": "10.1.2.3"}
        got = await decode.complete(
            {**body, "kv_transfer_params": elsewhere, "cache_salt": "x"}, endpoint=COMPLETIONS
        )
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert decode.pd.pulls.refused == 2
    finally:
        await drop_holds(other)
        await other.aclose()


@pytest.mark.parametrize(
    "params",
    [
        "yes",
        {"do_remote_decode": 1},
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "x"},
        {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": 70000,
            "remote_request_id": "x",
            "remote_block_ids": [],
        },
        {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "remote_request_id": "x",
            "remote_block_ids": [-1],
        },
        {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "remote_request_id": "x",
            "remote_block_ids": None,
        },
    ],
)
async def test_malformed_kv_transfer_params_are_a_400(trio, params) -> None:
    _, decode, _ = trio
    with pytest.raises(EngineRequestError) as err:
        await decode.complete(request("hi", kv_transfer_params=params), endpoint=COMPLETIONS)
    assert err.value.param == "kv_transfer_params"


async def test_roles_take_only_their_own_step(trio) -> None:
    prefill, decode, colocated = trio
    with pytest.raises(EngineRequestError, match="role is 'decode'"):
        await decode.complete(request("hi", kv_transfer_params=STEP1), endpoint=COMPLETIONS)
    step3 = {
        **STEP1,
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "x",
        "remote_block_ids": [],
    }
    with pytest.raises(EngineRequestError, match="role is 'prefill'"):
        await prefill.complete(request("hi", kv_transfer_params=step3), endpoint=COMPLETIONS)
    with pytest.raises(EngineRequestError, match="stream"):
        await anext(prefill.stream(request("hi", stream=True, kv_transfer_params=STEP1)))
    # Without a PD config (the gateway's local route) the field is ignored, as before.
    plain = await colocated.complete(request("hi", kv_transfer_params=STEP1), endpoint=COMPLETIONS)
    assert "kv_transfer_params" not in plain
