"""The standalone server, driven by the real `openai` SDK over loopback HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import orjson
import pytest
import uvicorn

from bench.harness import free_port
from engine_backend import LocalEngine
from engine_backend.server import build_parser, create_app, main
from tests.engine_front.faults import break_sampling
from tests.support.clients import sdk_client

LONG_TEXT = " ".join(f"rule {i}: answer briefly and cite the source." for i in range(12))


@pytest.fixture(scope="module")
def served(tiny_model_dir: str):
    local_engine = LocalEngine.from_model(
        tiny_model_dir, num_blocks=128, max_num_batched_tokens=256
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(local_engine),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "server did not start"
    yield f"http://127.0.0.1:{port}", local_engine
    server.should_exit = True
    thread.join(15)
    assert not thread.is_alive()
    assert not local_engine.thread.is_running


@pytest.fixture
def client(served) -> openai.OpenAI:
    with sdk_client(served[0], "key-a", timeout=30) as c:
        yield c


def messages(content: str = "Hello!") -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}]


def test_chat_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        messages=messages(),
        temperature=0,
        max_tokens=10,
        extra_body={"ignore_eos": True},
    )
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == streamed
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens > 10


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny",
        prompt="The capital of France is",
        temperature=0,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == full.choices[0].text


def test_models_lists_the_served_model(client: openai.OpenAI, served) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [served[1].model_name]
    assert client.models.retrieve(served[1].model_name).id == served[1].model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    unique_start = [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": "Hi"}]
    kwargs = dict(model="tiny", messages=unique_start, max_tokens=2)
    first = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    usage = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens == first.usage.prompt_tokens > 300
    assert usage.prompt_tokens - 16 <= usage.prompt_tokens_details.cached_tokens
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_bad_requests_are_openai_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages(), n=2)
    assert info.value.body["param"] == "n" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=messages(), stream=True, temperature=5
        )
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("seed", 2**64),
        ("chat_template_kwargs", {"tools": 1}),
        ("stream", "yes"),
        ("logit_bias", {"7": 5}),
    ],
)
def test_poison_values_are_400s_and_the_engine_keeps_serving(served, field, value) -> None:
    """What used to overflow inside a step (or break the template with a 500) is a 400 naming
    the field; a stream that was already running finishes in full."""
    base, local_engine = served
    body = {
        "model": "tiny",
        "messages": messages(),
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=base, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            for stream in (True, False):
                bad = http.post(
                    "/v1/chat/completions", json={**body, "stream": stream, field: value}
                )
                assert bad.status_code == 400, bad.text
                assert bad.json()["error"]["param"] == field
            rest = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert local_engine.thread.is_running


def test_a_request_failing_in_the_engine_is_a_500_or_an_in_stream_error(served) -> None:
    base, local_engine = served
    body = {"model": "tiny", "messages": messages(), "max_tokens": 5, "seed": 31337}
    restore = break_sampling(local_engine, 31337)
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            full = http.post("/v1/chat/completions", json=body)
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            fine = http.post("/v1/chat/completions", json={**body, "seed": 1})
    finally:
        restore()
    assert full.status_code == 500
    assert full.json()["error"]["message"] == "engine error: sampling failed (RuntimeError)"
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["type"] == "server_error"
    assert fine.status_code == 200 and local_engine.thread.is_running


def test_raw_sse_framing_and_errors(served) -> None:
    base = served[0]
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        response = http.post("/v1/chat/completions", content=b"{not json")
        assert response.status_code == 400
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/v1/nowhere").status_code == 404
        assert "error" in http.get("/v1/nowhere").json()
        body = {"model": "tiny", "messages": messages(), "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            raw = stream.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [orjson.loads(e[len(b"data: ") :]) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_disconnect_aborts_the_request(served) -> None:
    base, local_engine = served
    manager = local_engine.llm.block_manager
    body = {
        "model": "tiny",
        "messages": messages(),
        "max_tokens": 800,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=base, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert received[0].startswith("data: ")
            assert manager.num_free_blocks < manager.num_total_blocks
    deadline = time.monotonic() + 5
    while manager.num_free_blocks < manager.num_total_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert local_engine.llm.requests == {}


def test_cli_arguments_and_startup_errors(capsys) -> None:
    args = build_parser().parse_args(
        ["--demo", "--max-num-batched-tokens", "64", "--isolate-tenants"]
    )
    assert (args.host, args.port, args.max_num_batched_tokens, args.isolate_tenants) == (
        "127.0.0.1",
        8000,
        64,
        True,
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--demo", "--model", "x"])
    assert main(["--model", "/definitely/not/a/model/dir"]) == 2
    assert "no model folder" in capsys.readouterr().err
