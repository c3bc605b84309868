"""The bundled engine serves every tenant in one loop, so its inputs are checked at the front
and one bad request fails alone.

Against a `local` route in tenant mode: values that used to break an engine step for every
tenant are 400s naming the field and never reach the engine; a request that fails inside the
engine (its sampling) ends alone, in-stream or as a 502, and is never retried; an engine that
stopped is a 503; tenants do not share prefix-cache hits unless told to. Then a property-based
fuzz of the sampling fields against the engine itself.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_backend import EngineRequestError, LocalEngine
from engine_backend.demo import RandomModelSpec, write_random_model
from engine_backend.openai_response import CHAT
from tests.engine_front.faults import break_sampling
from tests.security.conftest import TENANT_A_KEY, TENANT_B_KEY, auth
from tests.support.clients import sdk_client

TINY = RandomModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    tokenizer_vocab_size=300,
)
LONG = "The quick brown fox jumps over the lazy dog. " * 12
MARK = 424242  # the seed of the request whose sampling the test breaks

# Each used to overflow inside the engine step, fail rendering with a 502, or be ignored.
POISON = [
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("top_k", -5),
    ("top_k", True),
    ("seed", 2**64),
    ("seed", "7"),
    ("seed", 1.5),
    ("temperature", True),
    ("temperature", 2.5),
    ("top_p", -1.0),
    ("max_tokens", 2**63),
    ("chat_template_kwargs", {"tools": 1}),
    ("chat_template_kwargs", {"messages": 1}),
    ("chat_template_kwargs", "x"),
    ("logit_bias", {"5": 100}),
    ("logit_bias", 3),
    ("min_tokens", 5),
    ("ignore_eos", "yes"),
    ("repetition_penalty", -1),
    ("presence_penalty", "high"),
    ("stop", "s" * 1000),
    ("cache_salt", {"a": 1}),
    ("tools", [{"type": "function", "function": {"name": 1}}]),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-engine")
    write_random_model(str(path), TINY)
    return str(path)


@pytest.fixture
def gateway(make_gateway, tenant_settings, tiny_model):
    gw = make_gateway(
        [{"name": "engine", "models": ["*"], "kind": "local", "model_path": tiny_model}],
        **tenant_settings,
    )
    gw.wait_ready()
    return gw


def local_engine(gw) -> LocalEngine:
    return gw.runtime.upstreams["engine"].local_engine


def count_submissions(engine: LocalEngine) -> list[dict]:
    """Record every request that reaches the engine thread (a spy; the call goes through)."""
    seen: list[dict] = []
    real = engine.thread.add_request

    async def add_request(prompt_token_ids, params, **kw):
        seen.append({"seed": params.seed})
        return await real(prompt_token_ids, params, **kw)

    engine.thread.add_request = add_request
    return seen


def greedy_chat(max_tokens: int, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": LONG}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


class Victim:
    """Tenant A's long greedy stream, read in a thread while the test attacks."""

    def __init__(self, gw, max_tokens: int = 150) -> None:
        self.gw = gw
        self.body = greedy_chat(max_tokens, stream=True, stream_options={"include_usage": True})
        self.started = threading.Event()
        self.chunks: list[dict] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.started.wait(30), "the victim's stream did not start"

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST",
                self.gw.url + "/v1/chat/completions",
                json=self.body,
                headers=auth(TENANT_A_KEY),
                timeout=60,
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(orjson.loads(line[6:]))
                        if len(self.chunks) >= 3:
                            self.started.set()
        except BaseException as exc:  # noqa: BLE001  # anything at all: finish() re-raises it
            self.error = exc
        finally:
            self.started.set()

    def finish(self) -> str:
        self._thread.join(60)
        assert not self._thread.is_alive() and self.error is None
        assert not any("error" in c for c in self.chunks), self.chunks[-2:]
        finishes = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        assert finishes[-1] == "length"
        assert self.chunks[-1]["usage"]["completion_tokens"] == self.body["max_tokens"]
        return "".join(
            c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices")
        )

    def alone(self) -> str:
        """The same request on a quiet engine: what the victim should have received."""
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        r = httpx.post(
            self.gw.url + "/v1/chat/completions", json=body, headers=auth(TENANT_A_KEY), timeout=60
        )
        return r.json()["choices"][0]["message"]["content"]


def test_poison_values_are_400s_that_never_reach_the_engine(gateway) -> None:
    engine = local_engine(gateway)
    submitted = count_submissions(engine)
    victim = Victim(gateway)
    with httpx.Client(base_url=gateway.url, headers=auth(TENANT_B_KEY), timeout=30) as http:
        for field, value in POISON:
            for stream in (True, False):
                body = {**greedy_chat(4), "stream": stream, field: value}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, (field, value, r.status_code, r.text)
                assert r.json()["error"]["param"] == field, (field, r.text)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "top_k": 2**63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    text = victim.finish()
    assert len(submitted) == 1, "a poison request reached the engine (or was retried)"
    assert engine.thread.is_running
    assert text == victim.alone()


def test_a_request_failing_in_the_engine_fails_alone_and_is_not_retried(gateway) -> None:
    engine = local_engine(gateway)
    break_sampling(engine, MARK)  # the engine must find that row and fail only its request
    submitted = count_submissions(engine)
    victim = Victim(gateway)
    marked = greedy_chat(20, temperature=1.0, seed=MARK)
    with httpx.Client(base_url=gateway.url, headers=auth(TENANT_B_KEY), timeout=30) as http:
        # Streamed: output has begun (the role chunk), so the failure is an in-stream error,
        # then [DONE], and nothing else.
        with http.stream("POST", "/v1/chat/completions", json={**marked, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [orjson.loads(e) for e in events[:-1]]
        assert payloads[-1]["error"]["message"].endswith("(sampling failed (RuntimeError))")
        assert not any(c.get("choices", [{}])[0].get("finish_reason") for c in payloads[:-1])
        # Not streamed, and a completion stream whose first output fails: a 502 before any
        # byte, not retried.
        r = http.post("/v1/chat/completions", json=marked)
        assert r.status_code == 502 and "sampling failed" in r.json()["error"]["message"]
        r = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": LONG, "stream": True, "max_tokens": 5, "seed": MARK},
        )
        assert r.status_code == 502 and "sampling failed" in r.json()["error"]["message"]
    assert sum(1 for s in submitted if s["seed"] == MARK) == 3, "a failed request was retried"
    text = victim.finish()
    assert text == victim.alone()
    llm = engine.llm
    assert (
        llm.requests == {}
        and llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks
    )
    # The SDK sees the in-stream error as an APIError, never a silent truncation.
    with pytest.raises(openai.APIError, match="sampling failed"):
        list(
            sdk_client(gateway, TENANT_B_KEY, timeout=60).chat.completions.create(
                stream=True, **{k: v for k, v in marked.items() if k != "ignore_eos"}
            )
        )


def test_an_engine_that_stopped_is_a_503(gateway) -> None:
    engine = local_engine(gateway)
    engine.thread.shutdown()
    with pytest.raises(openai.InternalServerError) as info:
        sdk_client(gateway, TENANT_A_KEY, timeout=60).chat.completions.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.status_code == 503


def usage(gw, key: str, content: str):
    chunks = list(
        sdk_client(gw, key, timeout=60).chat.completions.create(
            model="tiny",
            stream=True,
            max_tokens=2,
            temperature=0,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": content}],
        )
    )
    return chunks[-1].usage.prompt_tokens_details.cached_tokens


def test_tenant_mode_isolates_the_prefix_cache_by_default(gateway) -> None:
    """Without FIRSTTOKEN_ENGINE_ISOLATE_TENANTS, tenant B sending tenant A's exact prompt
    learns nothing from cached_tokens; each tenant still hits its own cache."""
    assert gateway.runtime.settings.engine_isolate_tenants is None
    assert usage(gateway, TENANT_A_KEY, LONG) == 0
    assert usage(gateway, TENANT_B_KEY, LONG) == 0
    assert usage(gateway, TENANT_A_KEY, LONG) >= 64
    assert usage(gateway, TENANT_B_KEY, LONG) >= 64  # only what B itself cached


# -- the engine itself, fuzzed ---------------------------------------------------------------

ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "cache_salt",
    "chat_template_kwargs",
    "tools",
]
SMALL_OUTPUT = st.one_of(st.integers(min_value=-3, max_value=3), ANY_JSON)


@pytest.fixture(scope="module")
def engine_loop(tiny_model):
    loop = asyncio.new_event_loop()
    engine = LocalEngine.from_model(tiny_model, num_blocks=96, max_num_batched_tokens=256)
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.aclose())
    loop.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fields=st.dictionaries(st.sampled_from(FIELDS), ANY_JSON, max_size=4), budget=SMALL_OUTPUT)
def test_fuzzed_sampling_fields_are_served_or_a_400(engine_loop, fields, budget) -> None:
    """Any JSON in any field the engine reads: a 400 naming a field or a normal answer, and
    the engine keeps running with nothing left behind."""
    engine, loop = engine_loop
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        **fields,
        "max_tokens": 3 if budget is None else budget,
    }  # not the whole context on a CPU
    if isinstance(fields.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = fields["max_completion_tokens"] % 4 + 1

    async def run() -> None:
        try:
            out = await engine.complete(body, endpoint=CHAT)
        except EngineRequestError as exc:
            assert exc.param in [*FIELDS, "messages"], exc.param
            return
        assert out["usage"]["completion_tokens"] >= 1
        async for chunk in engine.stream(body, endpoint=CHAT):
            assert "choices" in chunk

    loop.run_until_complete(asyncio.wait_for(run(), 30))
    assert engine.thread.is_running
    assert engine.llm.requests == {}
