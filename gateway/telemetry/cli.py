"""`firsttoken metrics`: the TTFT figures as a terminal table, read straight from Redis.

    firsttoken metrics [--tenant T | --all] [--window S] [--api API] [--redis-url URL]
                       [--prefix P] [--json]

The table has one row per tenant and route, then one per tenant and client API.

The Redis URL, key prefix and SLO targets come from the gateway's own settings
(`load_settings`: FIRSTTOKEN_REDIS_URL or REDIS_URL, FIRSTTOKEN_METRICS_KEY_PREFIX,
FIRSTTOKEN_TTFT_SLO_*), unless a flag overrides them, so the table shows the figures
`GET /v1/metrics/ttft` serves.
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

from gateway.config.settings import load_settings

from .event import APIS
from .keys import KeySpace
from .redis_store import RedisStore, connect
from .report import SloConfig, tenant_report

# One word per header, so the table splits on whitespace; the first two columns are text.
_COLUMNS = (
    "tenant",
    "route",
    "count",
    "errors",
    "err%",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "upstream_p50",
    "gateway_p50",
    "cache_hit",
    "slo_ms",
    "slo_met",
)
_TEXT_COLUMNS = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="firsttoken metrics", description="TTFT per tenant, route and client API."
    )
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--tenant", help="one tenant (default: all)")
    who.add_argument("--all", action="store_true", help="every tenant seen within retention")
    parser.add_argument(
        "--window", type=int, default=3600, help="seconds to look back (default 3600)"
    )
    parser.add_argument(
        "--api", choices=APIS, default=None, help="only requests of one client API (default: all)"
    )
    parser.add_argument(
        "--redis-url", default=None, help="default: FIRSTTOKEN_REDIS_URL, else REDIS_URL"
    )
    parser.add_argument(
        "--prefix", default=None, help="key prefix (default: FIRSTTOKEN_METRICS_KEY_PREFIX or 'ft')"
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


def _cell(value: Any, width: int = 24) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return text if len(text) <= width else text[: width - 1] + "…"


def _percent(share: float | None, digits: int = 1) -> str:
    return "-" if share is None else f"{share:.{digits}%}"


def _rows(reports: list[dict], breakdown: str, name: str) -> list[list[str]]:
    """One row per tenant and entry of `breakdown` (`routes` or `by_api`), named by `name`."""
    rows = []
    for report in reports:
        for entry in report[breakdown]:
            count = entry["count"]
            slo = entry["slo"]
            rows.append(
                [
                    _cell(report["tenant"]),
                    _cell(entry[name]),
                    str(count),
                    str(entry["errors"]),
                    _percent(entry["errors"] / count if count else None),
                    _cell(entry["ttft_ms"]["p50"]),
                    _cell(entry["ttft_ms"]["p90"]),
                    _cell(entry["ttft_ms"]["p99"]),
                    _cell(entry["upstream_ttft_ms"]["p50"]),
                    _cell(entry["gateway_ms"]["p50"]),
                    _percent(entry["cache_hit_ratio"]),
                    f"{slo['target_ms']:g}",
                    _percent(slo["attainment"], digits=2),
                ]
            )
    return rows


def format_table(reports: list[dict], window_s: int) -> str:
    """One row per tenant and route, then, after a blank line and a header naming `api`, one
    per tenant and client API: names left-aligned, figures right-aligned, two spaces between
    columns, both parts aligned alike (times in ms; `slo_met` is the share of TTFTs within
    `slo_ms`)."""
    rows = _rows(reports, "routes", "route")
    api_rows = _rows(reports, "by_api", "api")
    if not rows:
        return f"no TTFT figures in the last {window_s} s\n"
    api_columns = (_COLUMNS[0], "api", *_COLUMNS[2:])
    widths = [
        max(len(c), len(api_columns[i]), *(len(r[i]) for r in rows + api_rows))
        for i, c in enumerate(_COLUMNS)
    ]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        aligned = [
            cell.ljust(width) if i < _TEXT_COLUMNS else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(aligned).rstrip()

    lines = [line(_COLUMNS), *(line(row) for row in rows)]
    lines += ["", line(api_columns), *(line(row) for row in api_rows)]
    return "\n".join(lines) + f"\n(times in ms, last {window_s} s)\n"


async def _collect(
    store: RedisStore, tenant: str | None, window_s: int, slo: SloConfig, api: str | None = None
) -> list[dict]:
    now = time.time()
    if tenant is not None:
        return [await tenant_report(store, tenant, window_s, slo, now, api)]
    reports = [
        await tenant_report(store, t, window_s, slo, now, api) for t in await store.tenants()
    ]
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
    try:
        settings = load_settings(environ=environ)
        keys = KeySpace(args.prefix or settings.metrics_key_prefix)
    except ValueError as exc:  # SettingsError too
        print(f"firsttoken metrics: {exc}", file=sys.stderr)
        return 2
    url = args.redis_url or settings.effective_redis_url()
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
    slo = SloConfig.from_settings(settings)
    cluster = args.cluster or settings.redis_cluster

    async def run() -> list[dict]:
        store = RedisStore(connect(url, timeout_s=5.0, cluster=cluster), keys, retention_s=1)
        try:
            return await _collect(store, args.tenant, args.window, slo, args.api)
        finally:
            await store.aclose()

    try:
        reports = asyncio.run(run())
    except (redis.exceptions.RedisError, OSError) as exc:
        print(f"firsttoken metrics: cannot read Redis: {exc}", file=sys.stderr)
        return 1
    if args.json:
        body: Any = (
            reports[0]
            if args.tenant is not None
            else {"window_s": args.window, "api": args.api, "tenants": reports}
        )
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        out.write(format_table(reports, args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(metrics_main())
