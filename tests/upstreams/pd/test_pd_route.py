"""A `pd` route through the gateway against a vLLM-format fake of prefill and decode servers,
with the real OpenAI SDK: the three steps in order with vLLM's fields, colocated fallback on
every kind of prefill failure, decode faults, cancellation, prefix affinity and telemetry."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import openai
import pytest

from bench.mock_openai import ThreadedServer
from gateway.upstreams.pd import PDTiming
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV
from tests.support.waiting import eventually
from tests.upstreams.pd.clients import chat as pd_chat
from tests.upstreams.pd.clients import router
from tests.upstreams.pd.vllm_fake import ANSWER, FakeServer, Ledger, Script

SYSTEM = "You are a support agent for ACME. Answer briefly and politely. " * 12


class Pools:
    def __init__(self, stack: ExitStack, prefill: int, decode: int) -> None:
        self.ledger = Ledger()
        self.prefill = [FakeServer("prefill", f"p{i}", self.ledger) for i in range(prefill)]
        self.decode = [FakeServer("decode", f"d{i}", self.ledger) for i in range(decode)]
        self.servers = {
            fake.name: stack.enter_context(ThreadedServer(fake))  # type: ignore[arg-type]  # duck-typed: it only needs .app
            for fake in (*self.prefill, *self.decode)
        }

    def route(self, **extra) -> dict:
        pd = {
            "prefill": [
                {"name": f.name, "base_url": self.servers[f.name].base_url} for f in self.prefill
            ],
            "decode": [
                {"name": f.name, "base_url": self.servers[f.name].base_url} for f in self.decode
            ],
            **extra.pop("pd", {}),
        }
        return {
            "name": "pd",
            "models": ["*"],
            "kind": "openai",
            "api_key_env": UPSTREAM_KEY_ENV,
            "pd": pd,
            **extra,
        }

    def violations(self) -> list[str]:
        return [v for f in (*self.prefill, *self.decode) for v in f.violations]


@pytest.fixture
def pools():
    with ExitStack() as stack:
        yield lambda prefill=1, decode=2: Pools(stack, prefill, decode)


def chat(client, content: str = "hello", stream: bool = True, **extra) -> str:
    return pd_chat(client, content, stream, system=SYSTEM, **extra)


def test_streaming_request_takes_the_three_steps_in_order_with_vllms_fields(pools, make_gateway):
    p = pools()
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    messages = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model="m",
        messages=messages,
        stream=True,
        max_tokens=50,
        max_completion_tokens=40,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 3, "kv_transfer_params": {"remote_host": "10.0.0.66"}},
    )
    request_id = raw.headers["x-request-id"]
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == ANSWER
    assert p.violations() == []
    steps = p.ledger.for_request(request_id)
    assert [s.role for s in steps] == ["prefill", "decode"]
    prefill, decode = steps
    assert prefill.body["max_completion_tokens"] == 1
    assert p.ledger.answered[request_id] < decode.at  # decode only after the prefill answer
    # step 3 is the client's request as it was, with the prefill server's params instead of
    # anything the client put there
    assert decode.remote and decode.body["kv_transfer_params"] == p.ledger.issued[request_id]
    assert decode.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    assert decode.body["stream"] is True and decode.body["max_tokens"] == 50
    assert decode.body["max_completion_tokens"] == 40 and decode.body["min_tokens"] == 3
    assert decode.body["stream_options"] == {"include_usage": True}


def test_a_clients_own_request_id_never_pairs_the_steps(pools, make_gateway):
    """The client's x-request-id names its answer, but the id both servers pair on is the
    gateway's own: a tenant cannot choose (or collide with) another request's pairing id."""
    p = pools()
    gw = make_gateway([p.route()])
    client = sdk_client(gw, default_headers={"x-request-id": "client-chosen-1"})
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.parse().choices[0].message.content == ANSWER
    assert raw.headers["x-request-id"] == "client-chosen-1"
    ids = [step.request_id for step in p.ledger.steps]
    assert len(ids) == 4 and "client-chosen-1" not in ids
    assert ids[0] == ids[1] != ids[2] == ids[3]  # one id per request, shared by its two steps


def test_non_streaming_and_completions_requests_are_disaggregated_too(pools, make_gateway):
    p = pools()
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    assert chat(client, stream=False) == ANSWER
    text = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8)
    assert text.choices[0].text == ANSWER
    assert p.violations() == []
    decodes = p.ledger.decodes()
    assert len(decodes) == 2 and all(d.remote and d.body.get("stream") is not True for d in decodes)
    assert [s.role for s in p.ledger.steps] == ["prefill", "decode", "prefill", "decode"]


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (Script(status=500), "prefill_error"),
        (Script(status=503), "prefill_busy"),
        (Script(no_params=True), "no_kv_params"),
        (Script(delay_s=60.0), "prefill_timeout"),  # past the SDK's timeout (20 s)
    ],
)
def test_a_failed_prefill_falls_back_to_a_colocated_decode(pools, make_gateway, script, reason):
    p = pools()
    p.prefill[0].script(script)
    gw = make_gateway([p.route(pd={"prefill_timeout_s": 0.3})])
    client = sdk_client(gw)
    assert chat(client) == ANSWER  # an answer at all: a hung prefill was not waited out
    assert p.violations() == []
    (decode,) = p.ledger.decodes()
    assert not decode.remote  # an ordinary request
    assert decode.request_id == p.ledger.prefills()[0].request_id
    snap = router(gw).snapshot()["pd"]
    assert snap["colocated_by_reason"][reason] == 1 and snap["colocated_fallbacks"] == 1
    if reason == "prefill_timeout":  # the timed-out prefill request was closed, not left open
        assert eventually(lambda: p.prefill[0].disconnects == [decode.request_id], 10.0)


def test_an_ejected_prefill_pool_is_skipped_until_it_is_back(pools, make_gateway):
    # Back by a probe, not by the end of a backoff: a short backoff could end before the
    # second request on a slow machine, and then that request would rightly try p0 again.
    p = pools()
    p.prefill[0].script(Script(status=500))
    p.prefill[0].models_status = 503  # the probes fail until p0 is back
    gw = make_gateway([p.route(eject_s=30, probe_interval_s=0.1)])
    client = sdk_client(gw)
    assert chat(client) == ANSWER  # prefill failed: colocated, p0 ejected
    assert chat(client, "again") == ANSWER  # no healthy prefill server: not even tried
    assert len(p.ledger.prefills()) == 1
    reasons = router(gw).snapshot()["pd"]["colocated_by_reason"]
    assert reasons["prefill_error"] == 1 and reasons["no_prefill_server"] == 1
    p.prefill[0].models_status = 200
    assert eventually(lambda: router(gw).snapshot()["prefill"][0]["state"] == "healthy", 10.0)
    assert chat(client, "later") == ANSWER  # back: disaggregated again
    assert p.ledger.decodes()[-1].remote


def test_a_decode_server_that_fails_the_handoff_is_retried_colocated(pools, make_gateway):
    p = pools()
    for fake in p.decode:  # a KV pull fails on either decode server; ordinary requests work
        fake.always = Script(status=500, remote_only=True)
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    assert chat(client) == ANSWER
    assert p.violations() == []
    first, second = p.ledger.decodes()
    assert first.remote and not second.remote and first.server != second.server
    snap = router(gw).snapshot()
    assert snap["pd"]["colocated_by_reason"]["handoff_failed"] == 1
    # an error answer to a KV pull may be the prefill side's fault: no decode server ejected
    assert all(s["state"] == "healthy" for s in snap["decode"])


def test_a_decode_server_dying_mid_stream_errors_its_client_and_is_ejected(pools, make_gateway):
    p = pools()
    p.decode[0].always = Script(die_after=2)
    gw = make_gateway([p.route(eject_s=30)])
    client = sdk_client(gw)
    outcomes = []
    for i in range(2):  # least loaded with ties taken in turn: one of these reaches d0
        try:
            outcomes.append(chat(client, f"q{i}"))
        except openai.APIError as exc:
            outcomes.append(f"error: {exc.message}")
    assert sorted(o == ANSWER for o in outcomes) == [False, True], outcomes
    snap = router(gw).snapshot()
    states = {s["name"]: s["state"] for s in snap["decode"]}
    assert states == {"d0": "ejected", "d1": "healthy"}
    before = len(p.decode[0].posts())
    for i in range(4):
        assert chat(client, f"after {i}") == ANSWER
    assert len(p.decode[0].posts()) == before  # all went to d1
    assert {s["name"]: s["state"] for s in snap["replicas"]}["decode/d0"] == "ejected"


def test_a_client_that_leaves_during_prefill_closes_the_prefill_request(pools, make_gateway):
    p = pools()
    p.prefill[0].script(Script(delay_s=60.0))  # closed by the gateway, or never answered
    gw = make_gateway([p.route()])
    impatient = sdk_client(gw, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        chat(impatient)
    assert eventually(lambda: len(p.prefill[0].disconnects) == 1, 10.0)
    time.sleep(0.2)
    assert p.ledger.decodes() == []  # nothing decoded for a client that left
    assert eventually(lambda: router(gw).snapshot()["prefill"][0]["in_flight"] == 0, 10.0)


def test_prefix_affinity_keeps_a_conversations_prefills_on_one_server(pools, make_gateway):
    p = pools(prefill=3, decode=2)
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    for n in range(6):
        messages = [{"role": "system", "content": f"Agent {n}. " + SYSTEM}]
        before = {f.name: len(f.posts()) for f in p.prefill}
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {turn} of session {n}"})
            list(client.chat.completions.create(model="m", messages=messages, stream=True))
            messages.append({"role": "assistant", "content": ANSWER})
        grew = sorted(len(f.posts()) - before[f.name] for f in p.prefill)
        assert grew == [0, 0, 3], grew
    assert sum(1 for f in p.prefill if f.posts()) >= 2  # sessions spread over the pool
    decoded = {d.server for d in p.ledger.decodes()}
    assert decoded == {"d0", "d1"}  # decode goes by load, not by prefix
    snap = router(gw).snapshot()
    assert sum(s["affinity_hits"] for s in snap["prefill"]) == 6 * 2
    assert p.violations() == []


def test_telemetry_keeps_the_steps_apart_and_adds_up(pools, make_gateway):
    p = pools()
    p.prefill[0].script(Script(delay_s=0.05))
    gw = make_gateway([p.route()])
    upstream = router(gw)
    timings: list[PDTiming] = []
    upstream.on_request = timings.append
    client = sdk_client(gw)
    for i in range(3):
        assert chat(client, f"q{i}") == ANSWER
    p.prefill[0].script(Script(status=500))
    assert chat(client, "falls back") == ANSWER
    assert eventually(lambda: len(timings) == 4, 10.0)
    snap = upstream.snapshot()
    pd = snap["pd"]
    assert pd["requests"] == 4 and pd["colocated_fallbacks"] == 1
    assert pd["prefill_count"] == pd["handoff_count"] == pd["decode_ttft_count"] - 1 == 3
    assert pd["prefill_ms_mean"] > 0 and pd["handoff_ms_mean"] > 0
    assert pd["decode_ttft_ms_mean"] > 0
    assert pd["prefill_ms_mean"] >= 50 / 3  # one of three prefills waited 50 ms
    (prefill,) = snap["prefill"]
    assert prefill["requests"] == 4 and prefill["errors"] == 1
    assert prefill["upstream_ttft_mean_ms"] == pd["prefill_ms_mean"]
    assert sum(d["requests"] for d in snap["decode"]) == 4
    assert sum(d["remote_prefills"] for d in snap["decode"]) == 3
    assert [t.colocated_reason for t in timings] == [None, None, None, "prefill_error"]
    assert all(t.decode_ttft_s and t.decode_ttft_s > 0 for t in timings)
    assert timings[-1].prefill_s is None and timings[-1].handoff_s is None
    assert all(t.prefill_s and t.handoff_s is not None for t in timings[:3])
    assert len({t.request_id for t in timings}) == 4


def test_a_prefill_that_ends_colocated_is_timed_where_operators_look(pools, make_gateway):
    """vLLM without a KV connector answers `kv_transfer_params: null`: the request decodes
    colocated, and the prefill it waited for shows in the step timings all the same."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.upstreams.pd.metrics import PDCollector

    p = pools()
    p.prefill[0].script(Script(no_params=True, delay_s=0.05))
    gw = make_gateway([p.route()])
    upstream = router(gw)
    timings: list[PDTiming] = []
    upstream.on_request = timings.append
    assert chat(sdk_client(gw)) == ANSWER
    assert eventually(lambda: len(timings) == 1, 10.0)
    (timing,) = timings
    assert timing.colocated_reason == "no_kv_params"
    assert timing.prefill_s is not None and timing.prefill_s >= 0.05
    ttft = httpx.get(f"{gw.url}/v1/metrics/ttft", timeout=20).json()
    pd = ttft["replicas"]["pd"]["pd"]
    assert pd["colocated_by_reason"]["no_kv_params"] == 1
    assert pd["prefill_count"] == 1 and pd["prefill_ms_mean"] >= 50
    registry = CollectorRegistry()
    registry.register(PDCollector({"pd": upstream}))
    text = generate_latest(registry).decode()
    assert 'firsttoken_pd_step_seconds_count{route="pd",step="prefill"} 1.0' in text


def test_prometheus_reads_a_pd_route_per_server_and_per_step(pools, make_gateway):
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.upstreams.pd.metrics import PDCollector
    from gateway.upstreams.replicas.metrics import FleetCollector

    p = pools()
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    for i in range(2):
        assert chat(client, f"q{i}") == ANSWER
    registry = CollectorRegistry()
    registry.register(FleetCollector({"pd": router(gw)}))
    registry.register(PDCollector({"pd": router(gw)}))
    text = generate_latest(registry).decode()
    assert 'firsttoken_replica_requests_total{replica="prefill/p0",route="pd"} 2.0' in text
    assert 'firsttoken_replica_healthy{replica="decode/d1",route="pd"} 1.0' in text
    assert 'firsttoken_pd_requests_total{route="pd"} 2.0' in text
    assert 'firsttoken_pd_step_seconds_count{route="pd",step="handoff"} 2.0' in text
    assert 'firsttoken_pd_colocated_total{reason="prefill_error",route="pd"} 0.0' in text


def test_a_big_body_parsed_in_a_worker_process_is_disaggregated_too(pools, make_gateway):
    p = pools()
    # SYSTEM alone is past 512 bytes
    gw = make_gateway([p.route()], big_body_bytes=512, big_body_workers=2)
    gw.wait_ready()
    assert chat(sdk_client(gw)) == ANSWER
    assert p.violations() == []
    (prefill,) = p.ledger.prefills()
    assert prefill.body["messages"][0]["content"] == SYSTEM.strip()  # the policies trim it
    assert p.ledger.decodes()[0].remote
