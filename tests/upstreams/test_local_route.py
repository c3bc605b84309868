"""The bundled engine behind the gateway: the `local` route kind, and the default with no
configuration."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest

from gateway.config.settings import Settings
from tests.support.clients import sdk_client
from tests.support.gateway import GatewayThread, capture_events, wait_for
from tests.support.tiny_model import tiny_spec, write_tiny_model

TINY = tiny_spec(max_position_embeddings=2048, tokenizer_vocab_size=300)
LONG = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory, "tiny-llama", TINY)


def local_route(path: str) -> dict:
    return {"name": "engine", "models": ["*"], "kind": "local", "model_path": path}


def sdk(gw, key: str = "k") -> openai.OpenAI:
    return sdk_client(gw, key, timeout=60)  # the engine's first step compiles: slow on CPU


def stream_usage(client: openai.OpenAI, content: str):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            stream=True,
            max_tokens=4,
            temperature=0,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": content}],
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def test_local_route_streams_and_reports_prefix_cache_hits(tiny_model, make_gateway):
    gw = make_gateway([local_route(tiny_model)])
    gw.wait_ready()
    c = sdk(gw)
    cold_text, cold = stream_usage(c, LONG)
    warm_text, warm = stream_usage(c, LONG)
    assert cold_text == warm_text and cold.completion_tokens >= 1
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens_details.cached_tokens >= 64
    resp = c.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, messages=[{"role": "user", "content": LONG}]
    )
    assert resp.choices[0].message.content == cold_text
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", n=2, messages=[{"role": "user", "content": "x"}])

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        routes = httpx.get(gw.url + "/v1/metrics/ttft").json()["routes"]
        if routes and routes[0]["count"] >= 2:
            break
        time.sleep(0.05)
    assert routes[0]["route"] == "engine" and routes[0]["cached_prompt_tokens"] >= 64


def test_a_pattern_route_answers_with_the_model_the_client_asked_for(tiny_model, make_gateway):
    """`local-*` matches many names; the SDK reads back the one it sent, never the folder's."""
    route = {"name": "engine", "models": ["local-*"], "kind": "local", "model_path": tiny_model}
    gw = make_gateway([route])
    gw.wait_ready()
    messages = [{"role": "user", "content": "hi"}]
    stream = sdk(gw).chat.completions.create(
        model="local-x", stream=True, max_tokens=2, messages=messages
    )
    chunks = list(stream)
    assert chunks and {chunk.model for chunk in chunks} == {"local-x"}
    whole = sdk(gw).chat.completions.create(model="local-x", max_tokens=2, messages=messages)
    assert whole.model == "local-x"
    # The engine's own name (the folder's) is not one this route serves: not listed.
    client = sdk(gw)
    assert client.models.list().data == []
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny-llama0")


def test_a_catch_all_local_route_lists_the_engines_model(tiny_model, make_gateway):
    gw = make_gateway([local_route(tiny_model)])
    gw.wait_ready()
    client = sdk(gw)
    (card,) = client.models.list().data
    assert client.models.retrieve(card.id) == card
    assert (
        client.chat.completions.create(
            model=card.id, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ).model
        == card.id
    )


def test_tenant_isolation_reaches_the_engine(tiny_model, make_gateway):
    gw = make_gateway(
        [local_route(tiny_model)], tenant_keys="a:key-a,b:key-b", engine_isolate_tenants=True
    )
    gw.wait_ready()
    stream_usage(sdk(gw, "key-a"), LONG)
    assert stream_usage(sdk(gw, "key-b"), LONG)[1].prompt_tokens_details.cached_tokens == 0
    assert stream_usage(sdk(gw, "key-a"), LONG)[1].prompt_tokens_details.cached_tokens >= 64


def test_no_configuration_serves_the_demo_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FIRSTTOKEN_CACHE_DIR", str(tmp_path))
    with GatewayThread(Settings()) as gw:
        gw.wait_ready(120)
        models = sdk(gw).models.list().data
        assert [m.id for m in models] == ["firsttoken-demo-random"]
        assert "random" in models[0].model_extra["description"].lower()
        _, _first = stream_usage(sdk(gw), LONG)
        _, second = stream_usage(sdk(gw), LONG)
        assert second.prompt_tokens_details.cached_tokens > 0


def test_client_leaving_mid_stream_frees_engine_blocks(tiny_model, make_gateway):
    """Once the engine has made the first token it is held between steps until the gateway posts
    the abort, so whatever the machine's speed, the request is still running when the client
    leaves; it must then stop within a step, not generate its 1,500 tokens for nobody."""
    gw = make_gateway([local_route(tiny_model)])
    gw.wait_ready()
    engine = gw.runtime.upstreams["engine"].local_engine
    llm, thread = engine.llm, engine.thread
    abort_posted = threading.Event()
    first_token = threading.Event()
    steps_after_abort = []
    real_step, real_abort = llm.step, thread.abort

    def step():
        # Held from the step after the first token, not from when the client has read it: on a
        # loaded machine the engine would otherwise finish all its tokens before the client
        # thread gets to read the first.
        if first_token.is_set():
            abort_posted.wait(30)  # hold generation until the gateway gives the request up
            steps_after_abort.append(1)
        outputs = real_step()
        if outputs:
            first_token.set()
        return outputs

    def abort(request_id):
        real_abort(request_id)
        abort_posted.set()

    llm.step, thread.abort = step, abort
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": LONG}],
    }
    try:
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            seen = []
            for line in r.iter_lines():
                seen.append(line)
                if '"content"' in line and '"content":""' not in line:
                    # Checked before the loop is left: leaving it closes the response (httpcore
                    # closes a stream whose iterator is closed), and the gateway may then abort
                    # the request before a check after the loop ran. What the client read and
                    # whether the gateway gave the request up, if it ended early:
                    assert llm.has_unfinished(), (seen[:3], seen[-3:], abort_posted.is_set())
                    break
            else:
                pytest.fail(f"the stream ended before any content: {seen[-3:]}")
        assert abort_posted.wait(30), "the gateway never gave up the request of a client that left"
        deadline = time.monotonic() + 30
        while llm.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not llm.has_unfinished(), "the engine kept generating for a client that left"
        # the step in flight when the abort came, and nothing after it
        assert len(steps_after_abort) <= 2, len(steps_after_abort)
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks
    finally:
        llm.step, thread.abort = real_step, real_abort
        abort_posted.set()


def test_messages_and_responses_apis_on_the_local_route(tiny_model, make_gateway):
    """Both other APIs are translated to chat for the engine: greedy, they say what chat says."""
    gw = make_gateway([local_route(tiny_model)])
    events = capture_events(gw)
    prompt = [{"role": "user", "content": LONG}]
    chat = sdk(gw).chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, messages=prompt
    )
    expected = chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0, timeout=60)
    greedy = {"temperature": 0}  # this SDK's signature has no `temperature`; the API has
    message = claude.messages.create(model="tiny", max_tokens=4, messages=prompt, extra_body=greedy)
    assert message.content[0].text == expected and message.model == "tiny"
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(
        model="tiny", max_tokens=4, messages=prompt, extra_body=greedy
    ) as stream:
        assert "".join(stream.text_stream) == expected
    response = sdk(gw).responses.create(
        model="tiny", max_output_tokens=4, temperature=0, input=LONG
    )
    assert response.output_text == expected
    streamed = list(
        sdk(gw).responses.create(
            model="tiny", max_output_tokens=4, temperature=0, input=LONG, stream=True
        )
    )
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    # Cut by max_output_tokens, as OpenAI ends such a response: `response.incomplete`.
    assert streamed[-1].type == "response.incomplete"
    final = streamed[-1].response
    assert "".join(deltas) == expected == final.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the engine's prefix cache hit
    recorded = [e for e in wait_for(events, count=2, api="messages") if e.stream]
    assert recorded and recorded[0].ttft_s is not None
    assert len(wait_for(events, count=2, api="responses")) == 2
