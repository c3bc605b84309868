"""A variant whose opt-in has nothing to act on is the observed request: it is not run, and the
advisor counts exactly what running it would have counted."""

from __future__ import annotations

import pytest

from gateway.advisor import ALL_OPT_INS, OBSERVED, OPT_INS, CacheAdvisor, guess_route
from gateway.advisor import variants as variants_module
from gateway.advisor.variants import ShadowChains, active_opt_ins
from policies import DEFAULT_POLICIES, PolicyContext, build_chain

SYSTEM = "You answer questions about the handbook. Be brief. " * 40


def _tool(name: str) -> dict:
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def _body(system: str = SYSTEM, user: str = "What is the refund policy?", **extra) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, **extra}


BODIES = {
    "plain": _body(),
    "json": _body(user='Parse this: ```json\n{ "a" :  [1,  2] }\n```'),
    "passages": _body(
        user='<passage id="2">Ships in 2 days.</passage> <passage id="1">Refunds in 5.</passage>'
    ),
    "tools": _body(tools=[_tool("search"), _tool("lookup")]),
    "sorted tools": _body(tools=[_tool("lookup"), _tool("search")]),
    "one tool": _body(tools=[_tool("search")]),
    "volatile": _body(system=SYSTEM + " Now: 2026-12-03T21:00:00Z, request 9f8e7d6c5b4a."),
    "developer list": {
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Build 3f2a9c1d7e6b4a."}]},
            {"role": "user", "content": "hi"},
        ],
    },
}
EXPECTED = {
    "plain": set(),
    "json": {"SLIM_MINIFY_JSON"},
    "passages": {"SLIM_DEDUPE_PASSAGES", "CANONICALIZE_SORT_PASSAGES"},
    "tools": {"CANONICALIZE_SORT_TOOLS", "CANONICALIZE_SORT_SCHEMA_KEYS"},
    "sorted tools": {"CANONICALIZE_SORT_SCHEMA_KEYS"},
    "one tool": {"CANONICALIZE_SORT_SCHEMA_KEYS"},
    "volatile": {"CANONICALIZE_VOLATILE"},
    "developer list": {"CANONICALIZE_VOLATILE"},
}


def _observed(body: dict):
    chain = build_chain(DEFAULT_POLICIES, {})
    return chain.apply(body, PolicyContext("chat", "openai", "gpt-4o", "acme"))


@pytest.mark.parametrize("name", list(BODIES))
def test_each_opt_in_is_active_where_it_has_something_to_act_on(name):
    result = _observed(BODIES[name])
    assert active_opt_ins(result.original_view, result.view) == EXPECTED[name]


def test_a_body_that_is_not_chat_shaped_leaves_every_opt_in_possible():
    assert active_opt_ins({"prompt": "hello"}, {"prompt": "hello"}) is None


def test_a_plain_request_runs_no_variant(monkeypatch):
    ran = []
    real = ShadowChains.chain
    monkeypatch.setattr(ShadowChains, "chain", lambda self, *a: ran.append(a) or real(self, *a))
    result = _observed(BODIES["plain"])
    _, prints = ShadowChains().fingerprints(result, guess_route(result), "acme")
    assert ran == []
    assert all(prints[variant] is prints[OBSERVED] for variant in (*OPT_INS, ALL_OPT_INS))


def test_only_the_active_opt_ins_and_all_of_them_run(monkeypatch):
    ran = []
    real = ShadowChains.chain
    monkeypatch.setattr(ShadowChains, "chain", lambda self, *a: ran.append(a[1]) or real(self, *a))
    result = _observed(BODIES["tools"])
    ShadowChains().fingerprints(result, guess_route(result), "acme")
    assert sorted(ran) == sorted(
        ["CANONICALIZE_SORT_TOOLS", "CANONICALIZE_SORT_SCHEMA_KEYS", ALL_OPT_INS]
    )


def test_the_short_cut_counts_what_running_every_variant_counts(monkeypatch):
    """Two turns of each body through the accounting, with and without the short-cut: the
    same family, counters and history blob."""

    def run() -> list:
        chains, history, out = ShadowChains(), {}, []
        for name, body in BODIES.items():
            for turn in range(2):
                messages = [*body["messages"], *[{"role": "user", "content": "more"}] * turn]
                result = _observed({**body, "messages": messages})
                route = guess_route(result)
                family, prints = chains.fingerprints(result, route, "acme")
                fields, blob = CacheAdvisor.account(history.get(family), prints, route)
                history[family] = blob
                out.append((name, family, fields, blob))
        return out

    short_cut = run()
    monkeypatch.setattr(variants_module, "active_opt_ins", lambda original, observed: None)
    assert short_cut == run()
