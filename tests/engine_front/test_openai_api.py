"""LocalEngine: OpenAI request dicts to engine requests, and OpenAI-shaped results back."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_backend import EngineConfig, EngineRequestError, LocalEngine
from engine_backend.openai_response import CHAT, COMPLETIONS

LONG_TEXT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(10))


@pytest.fixture
async def local(tiny_model_dir: str):
    local_engine = LocalEngine.from_model(
        tiny_model_dir, num_blocks=128, max_num_batched_tokens=256, isolate_tenants=True
    )
    await local_engine.start()
    yield local_engine
    await local_engine.aclose()


def chat(content: str = "Hello!", **extra) -> dict:
    return {
        "model": "x",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
        **extra,
    }


async def test_chat_stream_has_openai_shape(local: LocalEngine) -> None:
    chunks = [
        c
        async for c in local.stream(
            chat(stream=True, stream_options={"include_usage": True}), endpoint=CHAT
        )
    ]
    first, *middle, finish, usage = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["delta"].keys() == {"content"} for c in middle)
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    full = await local.complete(chat(), endpoint=CHAT)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"]["content"] for c in chunks[:-2]
    )
    prompt_ids = local.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)
    assert full["usage"]["total_tokens"] == len(prompt_ids) + 8


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
async def test_responses_name_the_model_the_client_asked_for(local: LocalEngine, endpoint) -> None:
    """The gateway's `local-*` route passes on whatever name matched; clients read it back."""
    body = chat(max_tokens=2) if endpoint is CHAT else {"prompt": "Hi", "max_tokens": 2}
    asked = {**body, "model": "local-x"}
    chunks = [c async for c in local.stream(asked, endpoint=endpoint)]
    assert chunks and {c["model"] for c in chunks} == {"local-x"}
    assert (await local.complete(asked, endpoint=endpoint))["model"] == "local-x"
    unnamed = {k: v for k, v in body.items() if k != "model"}
    assert (await local.complete(unnamed, endpoint=endpoint))["model"] == local.model_name


async def test_without_include_usage_there_is_no_usage_chunk(local: LocalEngine) -> None:
    chunks = [c async for c in local.stream(chat(max_tokens=3), endpoint=CHAT)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


async def test_completion_shapes_and_token_prompt(local: LocalEngine) -> None:
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    full = await local.complete(body, endpoint=COMPLETIONS)
    assert full["object"] == "text_completion"
    chunks = [c async for c in local.stream({**body, "stream": True}, endpoint=COMPLETIONS)]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ids = local.tokenizer.encode("Once upon a time", add_special_tokens=True)
    by_ids = await local.complete({**body, "prompt": [ids]}, endpoint=COMPLETIONS)
    assert by_ids["choices"][0]["text"] == full["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_cached_tokens_and_tenant_isolation(local: LocalEngine) -> None:
    body = chat(LONG_TEXT, max_tokens=2)
    first = await local.complete(body, endpoint=CHAT, tenant="a")
    again = await local.complete(body, endpoint=CHAT, tenant="a")
    other = await local.complete(body, endpoint=CHAT, tenant="b")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens - 16 <= cached < prompt_tokens
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_stop_and_max_completion_tokens(local: LocalEngine) -> None:
    reference = (
        await local.complete(
            {"prompt": "abc", "temperature": 0, "max_tokens": 30, "ignore_eos": True},
            endpoint=COMPLETIONS,
        )
    )["choices"][0]["text"]
    stop = reference[10:13]
    cut = reference.find(stop)
    stopped = await local.complete(
        {"prompt": "abc", "temperature": 0, "max_tokens": 30, "ignore_eos": True, "stop": stop},
        endpoint=COMPLETIONS,
    )
    assert stopped["choices"][0] == {
        "index": 0,
        "text": reference[:cut],
        "logprobs": None,
        "finish_reason": "stop",
    }
    both = await local.complete(
        {"prompt": "abc", "max_tokens": 30, "max_completion_tokens": 4, "ignore_eos": True},
        endpoint=COMPLETIONS,
    )
    assert both["usage"]["completion_tokens"] == 4


async def test_seeded_sampling_is_reproducible(local: LocalEngine) -> None:
    body = chat(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    a, b = await asyncio.gather(
        local.complete(body, endpoint=CHAT), local.complete(body, endpoint=CHAT)
    )
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_text_content_parts_are_joined(local: LocalEngine) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]
    as_parts = await local.complete(chat(parts), endpoint=CHAT)
    as_string = await local.complete(chat("Hello!"), endpoint=CHAT)
    assert as_parts["choices"] == as_string["choices"]


@pytest.mark.parametrize(
    "body, param",
    [
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
    ],
)
async def test_bad_requests_fail_before_the_first_chunk(local, body, param) -> None:
    stream = local.stream({**body, "stream": True}, endpoint=CHAT)
    with pytest.raises(EngineRequestError) as info:
        await stream.__anext__()
    assert info.value.param == param
    with pytest.raises(EngineRequestError):
        await local.complete(body, endpoint=CHAT)


def deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"type": "object", "properties": {"x": value}}
    return value


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("top_k", 2**31),
        ("top_k", -2),
        ("top_k", True),
        ("top_k", 1.5),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", "1"),
        ("seed", True),
        ("temperature", True),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -0.1),
        ("temperature", "1"),
        ("top_p", float("nan")),
        ("top_p", 1.01),
        ("top_p", -0.1),
        ("top_p", False),
        ("max_tokens", True),
        ("max_tokens", 2**70),
        ("max_tokens", 1.0),
        ("max_tokens", -1),
        ("max_completion_tokens", "5"),
        ("max_completion_tokens", 0),
        ("presence_penalty", 5),
        ("frequency_penalty", "x"),
        ("repetition_penalty", -1),
        ("min_p", 2),
        ("logit_bias", {"5": 10}),
        ("logit_bias", [1]),
        ("min_tokens", 3),
        ("min_tokens", -1),
        ("n", True),
        ("n", 0),
        ("best_of", 2),
        ("top_logprobs", 2),
        ("echo", True),
        ("ignore_eos", "false"),
        ("ignore_eos", 1),
        ("stream", "yes"),
        ("stream_options", []),
        ("stream_options", {"include_usage": "yes"}),
        ("stop", "x" * 1000),
        ("stop", ["a"] * 17),
        ("stop", {"a": 1}),
        ("cache_salt", 5),
        ("model", 5),
        ("model", "m" * 2000),
        ("cache_salt", "s" * 5000),
        ("chat_template_kwargs", [1]),
        ("chat_template_kwargs", {"tools": 1}),
        ("chat_template_kwargs", {"messages": []}),
        ("chat_template_kwargs", {"add_generation_prompt": "no"}),
        ("tools", {"a": 1}),
        ("tools", [1]),
        ("tools", [{"type": "function", "function": 5}]),
        ("tools", [{"type": "function", "function": {"name": 5}}]),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": deep(5000)}}]),
    ],
)
async def test_every_field_the_engine_reads_is_checked(local, field, value) -> None:
    """A wrong type or range is a 400 naming the field, for the stream and the full answer,
    and never reaches the engine (nothing is queued, nothing is left behind)."""
    body = {**chat(), field: value}
    stream = local.stream(body, endpoint=CHAT)
    with pytest.raises(EngineRequestError) as info:
        await stream.__anext__()
    assert info.value.param == field
    with pytest.raises(EngineRequestError) as info:
        await local.complete(body, endpoint=CHAT)
    assert info.value.param == field
    if field not in ("tools", "chat_template_kwargs"):  # chat only: completions never read them
        with pytest.raises(EngineRequestError):
            await local.complete(
                {"prompt": "Hi", "max_tokens": 2, field: value}, endpoint=COMPLETIONS
            )
    assert local.llm.requests == {} and not local.llm.has_unfinished()


@pytest.mark.parametrize(
    "content, name",
    [
        ([{"type": "text", "text": {"nested": 1}}], None),
        ([{"type": "text", "text": 5}], None),
        (["plain string part"], None),
        (5, None),
        ("ok", 5),
    ],
)
async def test_message_fields_templates_read_are_typed(local, content, name) -> None:
    message = {"role": "user", "content": content, **({"name": name} if name else {})}
    with pytest.raises(EngineRequestError) as info:
        await local.complete({"messages": [message], "max_tokens": 2}, endpoint=CHAT)
    assert info.value.param == "messages"


async def test_values_at_their_bounds_are_served(local: LocalEngine) -> None:
    for extra in (
        {"top_k": 2**31 - 1, "temperature": 2, "top_p": 0, "seed": 2**64 - 1},
        {"top_k": -1, "seed": -(2**63), "temperature": 1e-30},
        {
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "logit_bias": {},
            "min_tokens": 0,
            "stream": False,
            "stream_options": None,
            "n": 1,
            "chat_template_kwargs": {"add_generation_prompt": True},
        },
    ):
        out = await local.complete({**chat(), **extra, "max_tokens": 3}, endpoint=CHAT)
        assert out["usage"]["completion_tokens"] == 3


async def test_a_template_that_breaks_on_the_kwargs_is_a_400(local: LocalEngine) -> None:
    local.tokenizer.chat_template += "{% if budget is defined %}{{ 100 // budget }}{% endif %}"
    local.tokenizer._compiled_template = None
    ok = await local.complete({**chat(), "chat_template_kwargs": {"budget": 4}}, endpoint=CHAT)
    assert ok["usage"]["completion_tokens"] == 8
    with pytest.raises(EngineRequestError, match="ZeroDivisionError") as info:
        await local.complete({**chat(), "chat_template_kwargs": {"budget": 0}}, endpoint=CHAT)
    assert info.value.param == "chat_template_kwargs"


async def test_bad_completion_prompts(local: LocalEngine) -> None:
    for prompt, match in (
        (["a", "b"], "batched"),
        (None, "prompt"),
        ([10**9], "vocabulary"),
        ("", "empty"),
    ):
        with pytest.raises(EngineRequestError, match=match) as info:
            await local.complete({"prompt": prompt, "max_tokens": 2}, endpoint=COMPLETIONS)
        assert info.value.param == "prompt"


async def test_closing_the_stream_aborts_the_request(local: LocalEngine) -> None:
    stream = local.stream(chat(max_tokens=400), endpoint=CHAT)
    await stream.__anext__()
    await stream.__anext__()
    manager = local.llm.block_manager
    assert manager.num_free_blocks < manager.num_total_blocks
    await stream.aclose()
    deadline = time.monotonic() + 2
    while manager.num_free_blocks < manager.num_total_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert manager.num_free_blocks == manager.num_total_blocks


def test_demo_model_card_says_random(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FIRSTTOKEN_CACHE_DIR", str(tmp_path))
    local_engine = LocalEngine.from_model(demo=True, num_blocks=16)
    (card,) = local_engine.model_cards()
    assert card["id"] == local_engine.model_name == "firsttoken-demo-random"
    assert card["object"] == "model" and "random" in card["description"].lower()
    with pytest.raises(ValueError):
        LocalEngine.from_model()


def test_an_option_given_as_none_takes_the_engine_default(tiny_model_dir: str) -> None:
    """The gateway passes its unset settings as None; they must not override EngineConfig."""
    default = EngineConfig(model="x").max_num_batched_tokens
    unset = LocalEngine.from_model(tiny_model_dir, num_blocks=16, max_num_batched_tokens=None)
    assert unset.llm.config.max_num_batched_tokens == default
    given = LocalEngine.from_model(tiny_model_dir, num_blocks=16, max_num_batched_tokens=64)
    assert given.llm.config.max_num_batched_tokens == 64
