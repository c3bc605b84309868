"""A `pd` route with `protocol: sglang` through the gateway against a fake of SGLang's prefill
and decode servers, with the real OpenAI SDK: the bootstrap fields on both requests, both in
flight at once, the decode server's answer to the client, and a colocated retry when the
prefill server fails.

The two requests of a pairing race each other to the servers, so the tests tell them apart by
what they carry (bootstrap fields or none), never by the order they came in, and prove that the
router let a request go by the fakes having seen its client leave, not by the clock."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from urllib.parse import urlsplit

import pytest

from bench.mock_openai import ThreadedServer
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV
from tests.support.waiting import eventually
from tests.upstreams.pd.clients import chat, router
from tests.upstreams.pd.sglang_fake import ANSWER, FakeServer, Ledger


class Pools:
    def __init__(self, stack: ExitStack, prefill: int, decode: int, ports: list) -> None:
        self.ledger = Ledger()
        self.prefill = [FakeServer("prefill", f"p{i}", self.ledger) for i in range(prefill)]
        self.decode = [FakeServer("decode", f"d{i}", self.ledger) for i in range(decode)]
        self.servers = {
            fake.name: stack.enter_context(ThreadedServer(fake))  # type: ignore[arg-type]  # duck-typed: it only needs .app
            for fake in (*self.prefill, *self.decode)
        }
        self.ports = ports  # per prefill server: its bootstrap_port in the config, or None
        for fake, port in zip(self.prefill, ports, strict=True):
            fake.expect(urlsplit(self.servers[fake.name].base_url).hostname, port or 8998)

    def route(self, pd: dict | None = None, **extra) -> dict:
        prefill = []
        for fake, port in zip(self.prefill, self.ports, strict=True):
            server = {"name": fake.name, "base_url": self.servers[fake.name].base_url}
            prefill.append(server if port is None else {**server, "bootstrap_port": port})
        decode = [{"name": f.name, "base_url": self.servers[f.name].base_url} for f in self.decode]
        return {
            "name": "pd",
            "models": ["*"],
            "kind": "openai",
            "api_key_env": UPSTREAM_KEY_ENV,
            "pd": {"protocol": "sglang", "prefill": prefill, "decode": decode, **(pd or {})},
            **extra,
        }

    def violations(self) -> list[str]:
        return [v for f in (*self.prefill, *self.decode) for v in f.violations]

    def left(self) -> list[int]:
        """The rooms of the requests, of either role, whose client left while the fake waited."""
        return sorted(room for f in (*self.prefill, *self.decode) for room in f.disconnects)


@pytest.fixture
def pools():
    with ExitStack() as stack:
        yield lambda prefill=1, decode=2, ports=None: Pools(
            stack, prefill, decode, ports or [None] * prefill
        )


@pytest.mark.parametrize("stream", [True, False])
def test_both_servers_get_the_same_request_with_the_bootstrap_fields(pools, make_gateway, stream):
    p = pools(prefill=2, ports=[None, 9123])
    p.ledger.together = 6  # all six in flight at once, so that the load spreads them
    gw = make_gateway([p.route()])
    client = sdk_client(gw)
    spoofed = {"bootstrap_host": "10.0.0.66", "bootstrap_port": 1, "bootstrap_room": 7}
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda i: chat(client, f"q{i}", stream=stream, max_tokens=9, extra_body=spoofed),
                range(6),
            )
        )
    assert answers == [ANSWER] * 6
    assert p.violations() == []
    prefills, decodes = p.ledger.of("prefill"), p.ledger.of("decode")
    assert len(prefills) == len(decodes) == 6
    assert {s.server for s in prefills} == {"p0", "p1"}
    for prefill in prefills:
        (decode,) = [d for d in decodes if d.room == prefill.room]
        assert decode.body == prefill.body  # the same request, sent at once (the fakes wait)
        assert prefill.body["bootstrap_host"] == "127.0.0.1"
        assert prefill.body["bootstrap_port"] == {"p0": 8998, "p1": 9123}[prefill.server]
        assert bool(prefill.body.get("stream")) is stream and prefill.body["max_tokens"] == 9
    assert len({s.room for s in prefills}) == 6  # a new room per request
    snap = router(gw).snapshot()
    assert snap["pd"]["requests"] == 6 and snap["pd"]["colocated_fallbacks"] == 0
    assert sum(d["remote_prefills"] for d in snap["decode"]) == 6
    assert eventually(lambda: router(gw).snapshot()["pd"]["prefill_count"] == 6, 10.0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_prefill_is_retried_colocated_on_a_decode_server(pools, make_gateway, stream):
    p = pools()
    p.prefill[0].fail_with = 500  # once the paired decode request is waiting for the KV
    gw = make_gateway([p.route(eject_s=30)])
    client = sdk_client(gw)
    assert chat(client, stream=stream) == ANSWER
    assert p.violations() == []
    decodes = p.ledger.of("decode")
    (paired,) = [d for d in decodes if d.paired]
    (colocated,) = [d for d in decodes if not d.paired]
    assert not any(k.startswith("bootstrap_") for k in colocated.body)
    # the decode server waiting for KV that never comes was let go, not waited out (that one
    # would have answered an error after KV_WAIT_S, its client still there)
    assert eventually(lambda: p.left() == [paired.room], 10.0)
    snap = router(gw).snapshot()
    assert snap["pd"]["colocated_by_reason"]["prefill_error"] == 1
    assert snap["prefill"][0]["state"] == "ejected"
    assert all(d["state"] == "healthy" for d in snap["decode"])
    # with the prefill pool ejected the next request does not even try it
    assert chat(client, "again", stream=stream) == ANSWER
    assert len(p.ledger.of("prefill")) == 1
    assert router(gw).snapshot()["pd"]["colocated_by_reason"]["no_prefill_server"] == 1


def test_a_prefill_that_never_finishes_is_timed_out_into_a_colocated_answer(pools, make_gateway):
    p = pools()
    p.prefill[0].delay_s = 60.0  # the KV would go long past the SDK's timeout (20 s)
    gw = make_gateway([p.route({"prefill_timeout_s": 0.3})])
    assert chat(sdk_client(gw)) == ANSWER  # an answer at all: the prefill was not waited for
    assert p.violations() == []
    assert router(gw).snapshot()["pd"]["colocated_by_reason"]["prefill_timeout"] == 1
    # one colocated decode request, and the paired one if it reached its server at all
    assert sorted(d.paired for d in p.ledger.of("decode")) in ([False], [False, True])
    # however far the pairing had got when the timeout fired, both its requests were closed
    assert eventually(lambda: p.left() == sorted(s.room for s in p.ledger.paired()), 10.0)


def test_protocol_and_bootstrap_port_are_validated(pools):
    from pydantic import ValidationError

    from gateway.config.routes import Route

    p = pools()
    Route.model_validate(p.route())
    with pytest.raises(ValidationError):
        Route.model_validate({**p.route(), "pd": {**p.route()["pd"], "protocol": "mooncake"}})
    bad = p.route()
    bad["pd"]["prefill"][0]["bootstrap_port"] = 70000
    with pytest.raises(ValidationError):
        Route.model_validate(bad)
