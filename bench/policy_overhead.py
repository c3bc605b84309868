"""Time per request of the policy chain on a 30k-token conversation.

Two cases: "first seen" (all content caches cleared before each request: a conversation the
gateway has never seen) and "next turn" (the session's history was seen in its previous request;
one new assistant and user message are not, so only they are counted). Each request body is freshly
parsed from JSON, as the gateway would receive it. Target: default chain, next turn, p50 < 2 ms.

    .venv/bin/python bench/policy_overhead.py
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cache_hit import conversation, paragraph
from policies import (
    DEFAULT_POLICIES,
    PolicyContext,
    build_chain,
    clear_caches,
    count_request_tokens,
)

TARGET_P50_MS = 2.0
TARGET_TOKENS = 30_000
FIRST_SEEN_RUNS = 30
NEXT_TURN_RUNS = 200
TIME_LIMIT_S = 60.0
RESULTS = Path(__file__).resolve().parent / "results" / "policy_overhead.json"
OPT_INS = {
    "SLIM_MINIFY_JSON": "true",
    "SLIM_DEDUPE_PASSAGES": "true",
    "SLIM_MAX_PROMPT_TOKENS": "100000",
    "CANONICALIZE_SORT_TOOLS": "true",
    "CANONICALIZE_SORT_SCHEMA_KEYS": "true",
    "CANONICALIZE_VOLATILE": "true",
    "CANONICALIZE_SORT_PASSAGES": "true",
}


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(int(share * len(ordered)), len(ordered) - 1)]


def measure(
    chain,
    raw_bodies: list[bytes],
    ctx: PolicyContext,
    cold: bool,
    deadline: float,
    transform_only: bool = False,
) -> list[float]:
    """Milliseconds per request. `transform_only` times what the gateway does before it sends
    the body upstream; token counts and fingerprints (`measure`) run while the upstream works."""
    run = chain.transform if transform_only else chain.apply
    samples = []
    for raw in raw_bodies:
        if time.perf_counter() > deadline:
            break
        body = orjson.loads(raw)  # fresh objects, as parsed from a request
        if cold:
            clear_caches()
        start = time.perf_counter()
        run(body, ctx)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def main() -> int:
    rng = random.Random(42)
    base = conversation(rng, TARGET_TOKENS + 3_000)  # the generator undershoots its target a little
    ctx = PolicyContext("chat", "openai", "gpt-4.1", "bench")
    turns = []
    for index in range(NEXT_TURN_RUNS):
        # the session's history (seen before) plus one new turn (never seen): the next request
        new_turn = [
            {"role": "assistant", "content": paragraph(rng, 40)},
            {"role": "user", "content": f"Turn {index}: " + paragraph(rng, 30)},
        ]
        turns.append(orjson.dumps({**base, "messages": base["messages"] + new_turn}))
    tokens = count_request_tokens(orjson.loads(turns[0]))
    first = orjson.dumps(conversation(random.Random(7), TARGET_TOKENS + 3_000))
    deadline = time.perf_counter() + TIME_LIMIT_S
    rows = []
    chains = (
        ("default", build_chain(DEFAULT_POLICIES, {})),
        ("opt-ins", build_chain(DEFAULT_POLICIES, OPT_INS)),
    )
    for stage, transform_only in (("full", False), ("transform", True)):
        for label, chain in chains:
            cold = measure(chain, [first] * FIRST_SEEN_RUNS, ctx, True, deadline, transform_only)
            clear_caches()
            chain.apply(orjson.loads(orjson.dumps(base)), ctx)  # the session's previous request
            warm = measure(chain, turns, ctx, False, deadline, transform_only)
            for case, samples in (("first seen", cold), ("next turn", warm)):
                rows.append(
                    {
                        "chain": label,
                        "stage": stage,
                        "case": case,
                        "runs": len(samples),
                        "p50_ms": statistics.median(samples),
                        "p95_ms": percentile(samples, 0.95),
                        "mean_ms": statistics.fmean(samples),
                    }
                )
    print(
        f"conversation: {tokens} prompt tokens, {len(orjson.loads(turns[0])['messages'])} messages"
    )
    print(
        "stage 'full' = transform + token counts + fingerprints; 'transform' = the part that "
        "runs before the gateway sends the body upstream"
    )
    print(
        f"{'chain':<9} {'stage':<10} {'case':<11} {'runs':>5} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8}"
    )
    for row in rows:
        print(
            f"{row['chain']:<9} {row['stage']:<10} {row['case']:<11} {row['runs']:>5} "
            f"{row['p50_ms']:>8.3f} {row['p95_ms']:>8.3f} {row['mean_ms']:>8.3f}"
        )
    target = next(
        r
        for r in rows
        if r["chain"] == "default" and r["case"] == "next turn" and r["stage"] == "full"
    )
    passed = target["p50_ms"] < TARGET_P50_MS
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"prompt_tokens": tokens, "target_p50_ms": TARGET_P50_MS, "rows": rows, "pass": passed},
            indent=2,
        )
    )
    verdict = "PASS" if passed else "FAIL"
    print(
        f"{verdict}: default chain, next turn, p50 {target['p50_ms']:.3f} ms "
        f"(target < {TARGET_P50_MS} ms)"
    )
    print(f"wrote {RESULTS}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
