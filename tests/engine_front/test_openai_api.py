"""LocalEngine: OpenAI request dicts to engine requests, and OpenAI-shaped results back."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_backend import EngineRequestError, LocalEngine

LONG_TEXT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(10))


@pytest.fixture
async def local(tiny_model_dir: str):
    engine = LocalEngine.from_model(tiny_model_dir, num_blocks=128, max_num_batched_tokens=256,
                                    isolate_tenants=True)
    await engine.start()
    yield engine
    await engine.aclose()


def chat(content: str = "Hello!", **extra) -> dict:
    return {"model": "x", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 8, "ignore_eos": True, **extra}


async def test_chat_stream_has_openai_shape(local: LocalEngine) -> None:
    chunks = [c async for c in local.chat_completion_stream(
        chat(stream=True, stream_options={"include_usage": True}))]
    first, *middle, finish, usage = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["delta"].keys() == {"content"} for c in middle)
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    full = await local.chat_completion(chat())
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"]["content"] for c in chunks[:-2])
    prompt_ids = local.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)
    assert full["usage"]["total_tokens"] == len(prompt_ids) + 8


async def test_without_include_usage_there_is_no_usage_chunk(local: LocalEngine) -> None:
    chunks = [c async for c in local.chat_completion_stream(chat(max_tokens=3))]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


async def test_completion_shapes_and_token_prompt(local: LocalEngine) -> None:
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    full = await local.completion(body)
    assert full["object"] == "text_completion"
    chunks = [c async for c in local.completion_stream({**body, "stream": True})]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ids = local.tokenizer.encode("Once upon a time", add_special_tokens=True)
    by_ids = await local.completion({**body, "prompt": [ids]})
    assert by_ids["choices"][0]["text"] == full["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_cached_tokens_and_tenant_isolation(local: LocalEngine) -> None:
    body = chat(LONG_TEXT, max_tokens=2)
    first = await local.chat_completion(body, tenant="a")
    again = await local.chat_completion(body, tenant="a")
    other = await local.chat_completion(body, tenant="b")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens - 16 <= cached < prompt_tokens
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_stop_and_max_completion_tokens(local: LocalEngine) -> None:
    reference = (await local.completion({"prompt": "abc", "temperature": 0, "max_tokens": 30,
                                         "ignore_eos": True}))["choices"][0]["text"]
    stop = reference[10:13]
    cut = reference.find(stop)
    stopped = await local.completion({"prompt": "abc", "temperature": 0, "max_tokens": 30,
                                      "ignore_eos": True, "stop": stop})
    assert stopped["choices"][0] == {"index": 0, "text": reference[:cut], "logprobs": None,
                                     "finish_reason": "stop"}
    both = await local.completion({"prompt": "abc", "max_tokens": 30,
                                   "max_completion_tokens": 4, "ignore_eos": True})
    assert both["usage"]["completion_tokens"] == 4


async def test_seeded_sampling_is_reproducible(local: LocalEngine) -> None:
    body = chat(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    a, b = await asyncio.gather(local.chat_completion(body), local.chat_completion(body))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_text_content_parts_are_joined(local: LocalEngine) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]
    as_parts = await local.chat_completion(chat(parts))
    as_string = await local.chat_completion(chat("Hello!"))
    assert as_parts["choices"] == as_string["choices"]


@pytest.mark.parametrize("body, param", [
    (chat(n=2), "n"),
    (chat(temperature=3), "temperature"),
    (chat(top_p="high"), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=100_000), "max_tokens"),
    (chat(stop=[1, 2]), "stop"),
    (chat(logprobs=True), "logprobs"),
    (chat("word " * 3000), "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
async def test_bad_requests_fail_before_the_first_chunk(local, body, param) -> None:
    stream = local.chat_completion_stream({**body, "stream": True})
    with pytest.raises(EngineRequestError) as info:
        await stream.__anext__()
    assert info.value.param == param
    with pytest.raises(EngineRequestError):
        await local.chat_completion(body)


async def test_bad_completion_prompts(local: LocalEngine) -> None:
    for prompt, match in ((["a", "b"], "batched"), (None, "prompt"), ([10**9], "vocabulary"),
                          ("", "empty")):
        with pytest.raises(EngineRequestError, match=match) as info:
            await local.completion({"prompt": prompt, "max_tokens": 2})
        assert info.value.param == "prompt"


async def test_closing_the_stream_aborts_the_request(local: LocalEngine) -> None:
    stream = local.chat_completion_stream(chat(max_tokens=400))
    await stream.__anext__()
    await stream.__anext__()
    manager = local.engine.block_manager
    assert manager.num_free_blocks < manager.num_total_blocks
    await stream.aclose()
    deadline = time.monotonic() + 2
    while manager.num_free_blocks < manager.num_total_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert manager.num_free_blocks == manager.num_total_blocks


def test_demo_model_card_says_random(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FIRSTTOKEN_CACHE_DIR", str(tmp_path))
    engine = LocalEngine.from_model(demo=True, num_blocks=16)
    (card,) = engine.model_cards()
    assert card["id"] == engine.model_name == "firsttoken-demo-random"
    assert card["object"] == "model" and "random" in card["description"].lower()
    with pytest.raises(ValueError):
        LocalEngine.from_model()
