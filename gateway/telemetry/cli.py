"""`firsttoken metrics`: the TTFT figures as a terminal table, read straight from Redis.

    firsttoken metrics [--tenant T | --all] [--window S] [--redis-url URL] [--prefix P] [--json]

SLO targets come from the same variables the gateway reads
(FIRSTTOKEN_TTFT_SLO_MS, FIRSTTOKEN_TTFT_SLO_TENANTS, FIRSTTOKEN_TTFT_SLO_OBJECTIVE),
so the table shows the figures `GET /v1/metrics/ttft` serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import redis.exceptions

from .keys import KeySpace
from .redis_store import RedisStore, connect
from .report import SloConfig, tenant_report

PREFIX_ENV = "FIRSTTOKEN_METRICS_KEY_PREFIX"
TRUE = frozenset({"1", "true", "yes", "on"})
_COLUMNS = (
    "tenant",
    "route",
    "count",
    "ttft p50",
    "ttft p90",
    "ttft p99",
    "upstream p50",
    "gateway p50",
    "cache hit",
    "slo",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="firsttoken metrics", description="TTFT per tenant and route."
    )
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--tenant", help="one tenant (default: all)")
    who.add_argument("--all", action="store_true", help="every tenant seen within retention")
    parser.add_argument(
        "--window", type=int, default=3600, help="seconds to look back (default 3600)"
    )
    parser.add_argument(
        "--redis-url", default=None, help="default: FIRSTTOKEN_REDIS_URL, else REDIS_URL"
    )
    parser.add_argument(
        "--prefix", default=None, help=f"key prefix (default: {PREFIX_ENV} or 'ft')"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the URL names a Redis Cluster node (default: FIRSTTOKEN_REDIS_CLUSTER)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report instead of a table"
    )
    return parser


def slo_from_env(environ: Mapping[str, str]) -> SloConfig:
    """The SLO settings from FIRSTTOKEN_TTFT_SLO_* (`tenant:ms,...` for per-tenant targets)."""
    tenants: dict[str, float] = {}
    for item in environ.get("FIRSTTOKEN_TTFT_SLO_TENANTS", "").split(","):
        if item.strip():
            tenant, _, ms = item.strip().rpartition(":")
            tenants[tenant] = float(ms)
    return SloConfig(
        default_ms=float(environ.get("FIRSTTOKEN_TTFT_SLO_MS", "1000")),
        tenants=tenants,
        objective=float(environ.get("FIRSTTOKEN_TTFT_SLO_OBJECTIVE", "0.99")),
    )


def _cell(value: Any, width: int = 24) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return text if len(text) <= width else text[: width - 1] + "…"


def _rows(reports: list[dict]) -> list[list[str]]:
    rows = []
    for report in reports:
        for route in report["routes"]:
            hit = route["cache_hit_ratio"]
            attainment = route["slo"]["attainment"]
            rows.append(
                [
                    _cell(report["tenant"]),
                    _cell(route["route"]),
                    str(route["count"]),
                    _cell(route["ttft_ms"]["p50"]),
                    _cell(route["ttft_ms"]["p90"]),
                    _cell(route["ttft_ms"]["p99"]),
                    _cell(route["upstream_ttft_ms"]["p50"]),
                    _cell(route["gateway_ms"]["p50"]),
                    "-" if hit is None else f"{hit:.1%}",
                    "-"
                    if attainment is None
                    else f"{attainment:.2%}<={route['slo']['target_ms']:g}ms",
                ]
            )
    return rows


def format_table(reports: list[dict], window_s: int) -> str:
    """A fixed-width table of one row per tenant and route (times in ms)."""
    rows = _rows(reports)
    if not rows:
        return f"no TTFT figures in the last {window_s} s\n"
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=False)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]
    return "\n".join(lines) + f"\n(times in ms, last {window_s} s)\n"


async def _collect(
    store: RedisStore, tenant: str | None, window_s: int, slo: SloConfig
) -> list[dict]:
    now = time.time()
    if tenant is not None:
        return [await tenant_report(store, tenant, window_s, slo, now)]
    reports = [await tenant_report(store, t, window_s, slo, now) for t in await store.tenants()]
    return [r for r in reports if r["routes"]]


def metrics_main(
    argv: list[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Entry point of `firsttoken metrics`; returns the process exit status."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    args = _parser().parse_args(argv)
    url = args.redis_url or environ.get("FIRSTTOKEN_REDIS_URL") or environ.get("REDIS_URL")
    if not url:
        print(
            "firsttoken metrics: no Redis URL (--redis-url, FIRSTTOKEN_REDIS_URL or REDIS_URL); "
            "the embedded store is only readable through the gateway's /v1/metrics/ttft",
            file=sys.stderr,
        )
        return 2
    if args.window <= 0:
        print("firsttoken metrics: --window must be a positive number of seconds", file=sys.stderr)
        return 2
    try:
        slo = slo_from_env(environ)
        keys = KeySpace(args.prefix or environ.get(PREFIX_ENV) or "ft")
    except ValueError as exc:
        print(f"firsttoken metrics: {exc}", file=sys.stderr)
        return 2

    async def run() -> list[dict]:
        cluster = args.cluster or environ.get("FIRSTTOKEN_REDIS_CLUSTER", "").lower() in TRUE
        store = RedisStore(connect(url, timeout_s=5.0, cluster=cluster), keys, retention_s=1)
        try:
            return await _collect(store, args.tenant, args.window, slo)
        finally:
            await store.aclose()

    try:
        reports = asyncio.run(run())
    except (redis.exceptions.RedisError, OSError) as exc:
        print(f"firsttoken metrics: cannot read Redis: {exc}", file=sys.stderr)
        return 1
    if args.json:
        body: Any = (
            reports[0] if args.tenant is not None else {"window_s": args.window, "tenants": reports}
        )
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        out.write(format_table(reports, args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(metrics_main())
