"""bench/fleet_http.py runs end to end at tiny sizes: engines, the gateway and the bare relay,
the workload, the slowdown, one tenant's failing requests, the JSON."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_fleet_bench_tiny_run(tmp_path) -> None:
    out = tmp_path / "fleet_http.json"
    argv = [sys.executable, os.path.join(ROOT, "bench", "fleet_http.py"), "--quick"]
    argv += ["--seconds", "6", "--replicas", "2", "--tenants", "3", "--rate", "1.5"]
    argv += ["--probes", "3", "--cold-prompts", "2", "--only", "prefix_affinity,floor"]
    argv += ["--turns", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    result = variants["prefix affinity"]
    assert result["requests"] > 0 and result["errors"] == 0
    # every turn, as the summary counted it (--turns)
    turns = result["turns"]
    assert len(turns) == result["requests"]
    assert {t["engine"] for t in turns} <= set(result["served"])
    assert all(t["ttft_ms"] > 0 and 0 <= t["tenant"] < 3 for t in turns)
    assert sum(1 for t in turns if t["index"] == 0) == len({t["session"] for t in turns})
    assert 0.0 < result["cached_share"] <= 1.0
    # the same turns replayed on caches that never evict: a tenant per engine holds the most
    assert 0.0 < result["cached_share_unbounded_placement"] <= result["cached_share_ceiling"] < 1
    assert math.isfinite(result["added_ttft_cold_prompt_ms"])  # both targets answered them
    assert result["hand_overs"]["failed"] == 0  # the engines answer a one-token completion
    assert set(result["prefix_waits"]) == {"requests", "waited_ms"}
    assert variants["bare Python relay"]["prefix_waits"] is None  # a router without the view
    assert sum(result["served"].values()) == result["requests"]
    failures = result["tenant_failures"]
    assert 400 in failures["statuses"] and failures["all_healthy"], failures
    assert "cached share of prompt tokens" in proc.stdout
    assert "if no cache evicted, a tenant per engine" in proc.stdout
    # and by phase, each beside what its placement allowed (the engines count a phase by when a
    # request reached them, the replay by when its turn began: the two are not compared here)
    by_phase = result["cached_share_by_phase"]["all"]
    for phase in ("before", "after"):
        assert result[f"cached_share_{phase}_slowdown"] == by_phase[phase]
        assert 0.0 <= result[f"cached_share_unbounded_placement_{phase}_slowdown"] <= 1.0
        assert f"  {phase} the slowdown" in proc.stdout
    judged = {t["target"]: t["met"] for t in json.loads(out.read_text())["targets"]}
    assert judged["warm follow-ups moved <= 2"] in (True, False)
    assert judged["one tenant's failures leave every replica healthy"] is True
    assert "cached share >= 90%: " in proc.stdout
    # the floor relays every request, taking the engines in turn
    floor = variants["bare Python relay"]
    assert floor["requests"] > 1 and floor["errors"] == 0, floor
    assert all(floor["served"].values()) and sum(floor["served"].values()) == floor["requests"]
    assert floor["router_cpu_idle_ms_per_s"] >= 0 and floor["router_cpu_s_per_1000"] > 0
    # each router's CPU is also read against the floor's in the same invocation
    assert floor["router_cpu_vs_bare_relay"] == 1.0
    ratio = result["router_cpu_s_per_1000"] / floor["router_cpu_s_per_1000"]
    assert math.isclose(result["router_cpu_vs_bare_relay"], ratio)
    assert "times the bare relay's" in proc.stdout and "x the bare relay's)" in proc.stdout


def test_cpu_breakdown_runs_prefix_affinity_again_with_parts_switched_off(monkeypatch) -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    monkeypatch.setattr(sys, "argv", ["fleet_http.py", "--cpu-breakdown", "--only", "gateway"])
    args = fleet_http.parse_args()
    chosen = fleet_http.variants(args)
    extra = [v for v in chosen if v.env]
    assert [v.balance for v in extra] == ["prefix_affinity"] * 3
    assert [v.env for v in extra] == list(fleet_http.BREAKDOWN.values())
    assert {"FIRSTTOKEN_POLICIES": "none", "FIRSTTOKEN_TELEMETRY": "false"} in [
        v.env for v in extra
    ]

    # each variant's settings reach its gateway beside the route, and --compiled's checkout
    started: list[dict] = []
    roots: list[str | None] = []

    def fake_start_gateway(upstream: str, env: dict, root: str | None = None):
        started.append(env)
        roots.append(root)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(fleet_http, "start_gateway", fake_start_gateway)
    compiled = fleet_http.Variant(fleet_http.COMPILED, "gateway", "prefix_affinity", root="/c")
    for variant in [*extra, compiled]:
        try:
            fleet_http.start_router(variant, ["http://127.0.0.1:9"], args)
        except RuntimeError:
            pass
    assert [{k: v for k, v in env.items() if k != "FIRSTTOKEN_ROUTES"} for env in started] == [
        *(v.env for v in extra),
        {},
    ]
    assert roots == [None] * len(extra) + ["/c"]
    assert all("FIRSTTOKEN_ROUTES" in env for env in started)


def test_the_hand_over_comparison_runs_prefix_affinity_with_and_without(monkeypatch) -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    args = fleet_http.parse_args(["--hand-over-ab", "2"])
    chosen = fleet_http.variants(args)
    assert [v.name for v in chosen] == [
        "PA hand-over 1",
        "PA no hand-over 1",
        "PA hand-over 2",
        "PA no hand-over 2",
    ]
    assert {v.balance for v in chosen} == {"prefix_affinity"}
    routes: list[dict] = []

    def fake_start_gateway(upstream: str, env: dict, root: str | None = None):
        routes.append(json.loads(env["FIRSTTOKEN_ROUTES"])[0])
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(fleet_http, "start_gateway", fake_start_gateway)
    for variant in chosen[:2]:
        try:
            fleet_http.start_router(variant, ["http://127.0.0.1:9"], args)
        except RuntimeError:
            pass
    assert "prefix_hand_over" not in routes[0] and routes[0]["load_metrics"] == "vllm"
    assert routes[1]["prefix_hand_over"] is False


def _result(**figures) -> dict:
    base = {
        "cached_share": 0.93,
        "ttft_p99_warm_ms": 700.0,
        "ttft_p99_after_slowdown_ms": 600.0,
        "slow_share_of_new_sessions": 0.05,
        "warm_follow_ups_moved": 1,
        "router_cpu_s_per_1000": 4.0,
        "tenant_failures": None,
    }
    return {**base, **figures}


def test_targets_judge_prefix_affinity_against_the_issue_and_sglang() -> None:
    sys.path.insert(0, ROOT)
    from bench.fleet_http import Variant, targets

    healthy = {"replica_states": {"e0": "healthy", "e1": "healthy"}, "all_healthy": True}
    ours = Variant("prefix affinity", "gateway", "prefix_affinity")
    ours.result = _result(tenant_failures=healthy, cached_share=0.92)
    switched_off = Variant("PA no policies", "gateway", "prefix_affinity", {"X": "1"})
    switched_off.result = _result(router_cpu_s_per_1000=1.0)  # never the one judged
    sglang = Variant("sglang cache_aware", "sglang")
    sglang.result = _result(cached_share=0.935, ttft_p99_warm_ms=750.0)
    met = {name: ok for name, ok, _ in targets([ours, switched_off, sglang])}
    assert met == {
        "cached share >= 90%": True,
        "cached share vs sglang-router": False,  # 92.0% under 93.5%
        "TTFT p99 after warm-up vs sglang-router": True,  # 700 ms under 750 ms
        "TTFT p99 after the slowdown vs sglang-router": True,  # equal counts as met
        "e0's share of new sessions <= 10%": True,
        "warm follow-ups moved <= 2": True,
        "one tenant's failures leave every replica healthy": True,
        "router CPU <= 2.5 ms per request": False,
    }
    # without sglang-router the comparisons are skipped, not passed
    skipped = {name: ok for name, ok, _ in targets([ours])}
    assert [n for n, ok in skipped.items() if ok is None] == [
        "cached share vs sglang-router",
        "TTFT p99 after warm-up vs sglang-router",
        "TTFT p99 after the slowdown vs sglang-router",
    ]
    ours.result["warm_follow_ups_moved"] = 3
    ours.result["slow_share_of_new_sessions"] = 0.11
    judged = {name: ok for name, ok, _ in targets([ours])}
    assert judged["warm follow-ups moved <= 2"] is False
    assert judged["e0's share of new sessions <= 10%"] is False
    assert targets([switched_off, sglang]) == []  # no default prefix affinity run: nothing judged


def test_only_selects_any_variant_by_its_name() -> None:
    """`--only` splits on commas, so no variant's name may hold one."""
    sys.path.insert(0, ROOT)
    import argparse

    from bench.fleet_http import variants

    every = variants(argparse.Namespace(cpu_breakdown=True, hand_over_ab=0, compiled="/c", only=""))
    assert all("," not in variant.name for variant in every)
    [compiled] = [v for v in every if v.root is not None]  # --compiled: from the copy at /c
    assert (compiled.root, compiled.balance, compiled.env) == ("/c", "prefix_affinity", {})
    wanted = [every[-1].name, "bare Python relay"]
    picked = variants(
        argparse.Namespace(cpu_breakdown=True, hand_over_ab=0, compiled=None, only=",".join(wanted))
    )
    assert sorted(v.name for v in picked) == sorted(wanted)


def test_the_fleet_engine_honours_stream_and_max_tokens() -> None:
    sys.path.insert(0, ROOT)
    import httpx

    from bench.harness import free_port, stop, wait_http

    port = free_port()
    argv = [sys.executable, "-m", "bench.fleet_engine", "--port", str(port), "--name", "e7"]
    argv += ["--gap-ms", "1", "--base-ms", "1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        wait_http(base + "/models", proc=proc)
        system = {"role": "system", "content": "w " * 64}
        messages = [system, {"role": "user", "content": "hello"}]
        answer = httpx.post(
            base + "/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 1, "stream": False},
            timeout=10,
        ).json()
        assert answer["choices"][0]["message"]["content"] == "e7"
        assert answer["usage"]["completion_tokens"] == 1
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the prefix is cached now; a stream answers at most max_tokens chunks
        body = {"model": "m", "messages": messages, "max_tokens": 3, "stream": True}
        events = [
            line
            for line in httpx.post(base + "/chat/completions", json=body, timeout=10).text.split(
                "\n"
            )
            if line.startswith("data: {")
        ]
        chunks = [json.loads(line[6:]) for line in events]
        contents = [c["choices"][0]["delta"].get("content") for c in chunks]
        assert contents == ["e7 ", "tok1 ", "tok2 ", None]
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    finally:
        stop(proc)


def test_routers_are_compared_with_sglang_router_on_the_same_turns() -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    def ran(name: str, kind: str, turns: list, cpu: float) -> fleet_http.Variant:
        variant = fleet_http.Variant(name, kind, "prefix_affinity" if kind == "gateway" else "")
        variant.result = {"warm_turns": turns, "router_cpu_s_per_1000": cpu}
        return variant

    ours = ran("prefix affinity", "gateway", [(1, 0, 745.0), (1, 1, 42.0), (2, 0, 400.0)], 3.0)
    floor = ran("bare Python relay", "floor", [(1, 0, 900.0), (7, 0, 50.0)], 1.5)
    sglang = ran("sglang cache_aware", "sglang", [(1, 0, 744.0), (1, 1, 40.0), (2, 0, 403.0)], 2.0)
    fleet_http.against_sglang_turns([ours, floor, sglang])
    fleet_http.relative_to_floor([ours, floor, sglang])
    assert ours.result["warm_ttft_minus_sglang_ms"] == 1.0  # median of +1, +2, -3
    assert floor.result["warm_ttft_minus_sglang_ms"] == 156.0  # the one turn both served
    assert sglang.result["warm_ttft_minus_sglang_ms"] is None
    assert ours.result["router_cpu_vs_bare_relay"] == 2.0
    assert sglang.result["router_cpu_vs_bare_relay"] == 2.0 / 1.5

    alone = ran("prefix affinity", "gateway", [(1, 0, 745.0)], 3.0)
    fleet_http.against_sglang_turns([alone])
    fleet_http.relative_to_floor([alone])
    assert alone.result["warm_ttft_minus_sglang_ms"] is None
    assert alone.result["router_cpu_vs_bare_relay"] is None


def test_cache_ceilings_replay_the_turns_where_they_went() -> None:
    sys.path.insert(0, ROOT)
    from bench.fleet_http import WORDS, Turn, Workload, cache_ceilings

    # one tenant, a 102-word system prompt ("<system> tenant0" and 100 words): a first turn of
    # 105 words (6 whole blocks, all of them system prompt), its follow-up 125 words (the answer
    # is the engine's name and 15 tokens), a second conversation's first turn 105 words again
    system = "tenant0 " + " ".join(WORDS[:100])
    workload = Workload(
        [system], [(0.0, 0, ["hi there"] * 2), (1.0, 0, ["bye now"])], [[0.0] * 2, [0.0]]
    )
    first, follow_up = Turn(0, 0, 0.0, 1.0, "e0", 0), Turn(0, 1, 0.5, 1.0, "e0", 0)
    prompt = 105 + 125 + 105

    together = cache_ceilings([first, follow_up, Turn(1, 0, 1.0, 1.0, "e0", 0)], workload)
    # the follow-up finds its first turn's 6 blocks, the second conversation the system prompt's
    assert together["placement"] == together["one_engine_per_tenant"] == 192 / prompt

    apart = cache_ceilings([first, follow_up, Turn(1, 0, 1.0, 1.0, "e1", 0)], workload)
    # on another engine the second conversation computes the system prompt again
    assert (apart["placement"], apart["one_engine_per_tenant"]) == (96 / prompt, 192 / prompt)
    # by phase: the second conversation started at 1.0 s, after a slowdown at 0.8 s
    phases = cache_ceilings([first, follow_up, Turn(1, 0, 1.0, 1.0, "e1", 0)], workload, 0.8)
    assert (phases["placement_before"], phases["placement_after"]) == (96 / 230, 0.0)

    failed = cache_ceilings([first, follow_up, Turn(1, 0, 1.0, None, None, 0)], workload)
    assert failed["placement"] == 96 / (105 + 125)  # a failed turn is not counted


def test_answer_tokens_shorten_every_answer_and_its_replay(monkeypatch) -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http
    from bench.fleet_http import WORDS, Turn, Workload, cache_ceilings

    monkeypatch.setattr(sys, "argv", ["fleet_http.py", "--quick", "--answer-tokens", "1"])
    assert fleet_http.make_workload(fleet_http.parse_args()).answer_tokens == 1
    monkeypatch.setattr(sys, "argv", ["fleet_http.py", "--answer-tokens", "0"])
    with pytest.raises(SystemExit):
        fleet_http.parse_args()

    # the conversations of the test above, each answer one token: the follow-up is 110 words
    system = "tenant0 " + " ".join(WORDS[:100])
    sessions = [(0.0, 0, ["hi there"] * 2), (1.0, 0, ["bye now"])]
    workload = Workload([system], sessions, [[0.0] * 2, [0.0]], answer_tokens=1)
    turns = [Turn(0, 0, 0.0, 1.0, "e0", 0), Turn(0, 1, 0.5, 1.0, "e0", 0)]
    together = cache_ceilings([*turns, Turn(1, 0, 1.0, 1.0, "e0", 0)], workload)
    assert together["placement"] == 192 / (105 + 110 + 105)


def test_engines_that_do_not_all_answer_are_all_stopped(monkeypatch) -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    started = []
    popen = fleet_http.subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    def second_never_answers(url, timeout=30.0, proc=None):
        if proc is started[1]:
            raise RuntimeError(f"{url} did not answer")

    monkeypatch.setattr(fleet_http.subprocess, "Popen", recording_popen)
    monkeypatch.setattr(fleet_http, "wait_http", second_never_answers)
    monkeypatch.setattr(sys, "argv", ["fleet_http.py", "--quick", "--replicas", "3"])
    try:
        with pytest.raises(RuntimeError, match="did not answer"):
            fleet_http.start_engines(fleet_http.parse_args())
        assert len(started) == 3
        assert all(proc.poll() is not None for proc in started)  # none left running
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_a_p99s_interval_holds_the_true_p99_about_as_often_as_it_says() -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    rng = random.Random(21)
    true_p99 = -math.log(0.01)  # of an exponential with mean 1
    held, widths = 0, []
    for _ in range(400):
        sample = [rng.expovariate(1.0) for _ in range(400)]
        low, high = fleet_http.quantile_interval(sample, 0.99)
        assert low <= fleet_http.percentile(sample, 0.99) <= high
        held += low <= true_p99 <= high
        widths.append(high - low)
    # at least 90% by construction (order statistics: a little more), never all of them
    assert 0.88 <= held / 400 < 0.99
    assert statistics.median(widths) < true_p99  # a bracket, not the whole range


def test_a_p99_over_too_few_samples_has_no_upper_end() -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    low, high = fleet_http.quantile_interval([float(i) for i in range(50)], 0.99)
    assert high == math.inf and 0 < low < 49
    assert all(math.isnan(end) for end in fleet_http.quantile_interval([], 0.99))
    # intervals read back from JSON carry null for an infinite end
    assert fleet_http.overlap([600.0, None], [700.0, 800.0])
    assert not fleet_http.overlap([100.0, 200.0], [201.0, 300.0])
    assert not fleet_http.overlap(None, [1.0, 2.0])


def test_a_p99_comparison_says_when_the_two_intervals_overlap() -> None:
    sys.path.insert(0, ROOT)
    from bench import fleet_http

    def result(p99: float, interval: tuple[float, float]) -> dict:
        return {
            "cached_share": 0.93,
            "ttft_p99_warm_ms": p99,
            "ttft_p99_warm_interval_ms": interval,
            "ttft_p99_after_slowdown_ms": p99,
            "ttft_p99_after_slowdown_interval_ms": (interval[0] + 1000, interval[1] + 1000),
            "slow_share_of_new_sessions": 0.05,
            "warm_follow_ups_moved": 0,
            "router_cpu_s_per_1000": 5.0,
        }

    ours = fleet_http.Variant("prefix affinity", "gateway", "prefix_affinity")
    theirs = fleet_http.Variant("sglang cache_aware", "sglang")
    ours.result, theirs.result = result(753, (598, 792)), result(746, (542, 824))
    judged = {name: (met, figures) for name, met, figures in fleet_http.targets([ours, theirs])}
    met, figures = judged["TTFT p99 after warm-up vs sglang-router"]
    assert met is False and "intervals overlap" in figures  # the verdict stays, the tie is said
    theirs.result = result(900, (850, 990))
    met, figures = dict((n, (m, f)) for n, m, f in fleet_http.targets([ours, theirs]))[
        "TTFT p99 after warm-up vs sglang-router"
    ]
    assert met is True and "overlap" not in figures
