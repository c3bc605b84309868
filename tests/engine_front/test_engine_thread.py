"""The threaded engine loop: streams match the synchronous engine, aborts free blocks,
stop strings cut the text and stop the sequence."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_backend import engine_thread as engine_thread_module
from engine_backend.engine_thread import EngineClosedError, EngineThread, RequestFailedError
from engine_backend.llm_engine import LLMEngine
from engine_backend.sampling import SamplingParams
from engine_backend.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine.engines import generate, make_llm

GREEDY = dict(temperature=0.0, ignore_eos=True)


# Blocks of 16 tokens, as the gateway's engine has them.
OPTIONS = {"num_blocks": 128, "block_size": 16, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str) -> LLMEngine:
    return make_llm(tiny_model_dir, **OPTIONS)


@pytest.fixture
async def thread(tiny_model_dir: str):
    tokenizer = Tokenizer(tiny_model_dir)
    _text_ids[:] = tokenizer.encode(_ASCII_TEXT)
    thread = EngineThread(make_llm(tiny_model_dir, **OPTIONS), tokenizer)
    thread.start()
    yield thread
    await asyncio.to_thread(thread.shutdown)
    assert not thread.is_running


_ASCII_TEXT = " ".join(f"item{i} costs {i * 37 % 101} coins;" for i in range(400))
_text_ids: list[int] = []


def prompt(n: int, offset: int = 0) -> list[int]:
    """n token ids of plain ASCII text, so the prompt ends on a whole character and the
    streamed text can be compared with a plain decode of the output ids."""
    assert _text_ids, "needs the thread fixture"
    assert offset + n <= len(_text_ids)
    return _text_ids[offset : offset + n]


async def wait_all_blocks_free(thread: EngineThread, timeout: float = 5.0) -> None:
    manager = thread.llm.block_manager
    deadline = time.monotonic() + timeout
    while manager.num_free_blocks != manager.num_total_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert thread.llm.requests == {}


async def collect(thread: EngineThread, ids: list[int], params: SamplingParams, **kw):
    stream = await thread.add_request(ids, params, **kw)
    outputs = [out async for out in stream]
    return outputs


async def test_concurrent_streams_match_the_synchronous_engine(thread, reference) -> None:
    prompts = [prompt(n, n) for n in (5, 40, 130, 300)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = generate(reference, prompts, params)
    results = await asyncio.gather(*(collect(thread, p, params) for p in prompts))
    for outputs, want, p in zip(results, expected, prompts, strict=False):
        assert [t for out in outputs for t in out.token_ids] == want
        assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].num_output_tokens == 12
        assert outputs[-1].num_prompt_tokens == len(p)
        text = "".join(out.text for out in outputs)
        # The bytes of a character the length cut left incomplete are dropped, not sent.
        assert text == thread.tokenizer.decode(want).rstrip("\ufffd")
    await wait_all_blocks_free(thread)


async def test_repeated_prompt_reports_cached_tokens(thread) -> None:
    ids = prompt(100)
    params = SamplingParams(max_tokens=2, **GREEDY)
    first = await collect(thread, ids, params)
    second = await collect(thread, ids, params)
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 96  # six full blocks; the last token is recomputed
    assert [t for o in first for t in o.token_ids] == [t for o in second for t in o.token_ids]


async def test_closing_the_stream_aborts_and_frees_blocks_at_once(thread) -> None:
    stream = await thread.add_request(prompt(200), SamplingParams(max_tokens=500, **GREEDY))
    received = [await stream.__anext__() for _ in range(3)]
    assert not received[-1].finished
    manager = thread.llm.block_manager
    assert manager.num_free_blocks < manager.num_total_blocks
    await stream.aclose()
    await wait_all_blocks_free(thread, timeout=2.0)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_cancelled_consumer_aborts_the_request(thread) -> None:
    got_one = asyncio.Event()

    async def consume() -> None:
        stream = await thread.add_request(prompt(64), SamplingParams(max_tokens=500, **GREEDY))
        try:
            async for _ in stream:
                got_one.set()
        finally:
            stream.abort()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_all_blocks_free(thread, timeout=2.0)


async def test_stop_string_cuts_text_and_stops_the_sequence(thread, reference) -> None:
    tok = thread.tokenizer
    ids = prompt(20, 3)
    full_ids = generate(reference, [ids], SamplingParams(max_tokens=40, **GREEDY))[0]
    full_text = tok.decode(full_ids)
    # A stop string that straddles tokens, taken from the middle of the greedy output.
    middle = len(tok.decode(full_ids[:20]))
    stop = full_text[middle - 2 : middle + 2]
    cut = full_text.find(stop)
    assert len(stop) == 4 and cut >= 0
    outputs = await collect(
        thread, ids, SamplingParams(max_tokens=40, **GREEDY), stop=["never-in-output-\x00", stop]
    )
    text = "".join(o.text for o in outputs)
    assert text == full_text[:cut]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert outputs[-1].num_output_tokens < 40
    # Text that could be the start of the stop string was held back, never sent early.
    assert all(stop not in o.text for o in outputs)
    await wait_all_blocks_free(thread)


async def test_a_sampling_failure_ends_that_stream_alone(thread, reference) -> None:
    """A row the sampler cannot draw (a top_k past int64 that bypassed every check) ends its
    own stream with RequestFailedError; the concurrent streams finish with their full output
    and the engine keeps serving."""
    prompts = [prompt(n, n) for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = generate(reference, prompts, params)
    poison = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    poison.top_k = 2**63

    async def poisoned() -> BaseException:
        stream = await thread.add_request(prompt(30, 7), poison)
        with pytest.raises(RequestFailedError, match="sampling failed") as info:
            async for _ in stream:
                pass
        return info.value

    *results, error = await asyncio.gather(
        *(collect(thread, p, params) for p in prompts), poisoned()
    )
    assert not isinstance(error, EngineClosedError)
    for outputs, want in zip(results, expected, strict=False):
        assert [t for out in outputs for t in out.token_ids] == want
        assert outputs[-1].finish_reason == "length"
    assert thread.is_running
    await wait_all_blocks_free(thread)
    again = await collect(thread, prompts[0], params)
    assert [t for out in again for t in out.token_ids] == expected[0]


async def test_a_detokenizer_failure_ends_that_stream_alone(thread, reference, monkeypatch) -> None:
    marker = prompt(30, 7)

    class Fragile(IncrementalDetokenizer):
        """Breaks on its third batch of tokens, for the marked prompt only."""

        def __init__(self, tokenizer, prompt_token_ids=None, **kw) -> None:
            super().__init__(tokenizer, prompt_token_ids, **kw)
            self.calls, self.fragile = 0, prompt_token_ids == marker

        def add(self, token_ids: list[int]) -> str:
            self.calls += 1
            if self.fragile and self.calls == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().add(token_ids)

    monkeypatch.setattr(engine_thread_module, "IncrementalDetokenizer", Fragile)
    prompts = [prompt(n, n) for n in (5, 40, 130)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = generate(reference, prompts, params)

    async def fragile() -> list:
        stream = await thread.add_request(marker, SamplingParams(max_tokens=40, **GREEDY))
        seen = []
        with pytest.raises(RequestFailedError, match="detokenization failed"):
            async for out in stream:
                seen.append(out)
        return seen

    *results, seen = await asyncio.gather(*(collect(thread, p, params) for p in prompts), fragile())
    assert len(seen) == 2 and not seen[-1].finished
    for outputs, want in zip(results, expected, strict=False):
        assert [t for out in outputs for t in out.token_ids] == want
        assert "".join(o.text for o in outputs) == thread.tokenizer.decode(want).rstrip("\ufffd")
    await wait_all_blocks_free(thread)  # the failed request was aborted in the engine too


async def test_engine_validation_error_reaches_the_caller(thread) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        await thread.add_request([10_000_000], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        await thread.add_request(prompt(10), SamplingParams(max_tokens=5000))
    outputs = await collect(thread, prompt(8), SamplingParams(max_tokens=3, **GREEDY))
    assert outputs[-1].num_output_tokens == 3


async def test_shutdown_fails_pending_streams(tiny_model_dir) -> None:
    _text_ids[:] = Tokenizer(tiny_model_dir).encode(_ASCII_TEXT)
    thread = EngineThread(make_llm(tiny_model_dir, **OPTIONS), Tokenizer(tiny_model_dir))
    thread.start()
    thread.start()  # idempotent
    stream = await thread.add_request(prompt(30), SamplingParams(max_tokens=900, **GREEDY))
    await stream.__anext__()
    await asyncio.to_thread(thread.shutdown)
    with pytest.raises(EngineClosedError):
        async for _ in stream:
            pass
    with pytest.raises(EngineClosedError):
        await thread.add_request(prompt(3), SamplingParams(max_tokens=1))
