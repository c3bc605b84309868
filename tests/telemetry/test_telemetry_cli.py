import asyncio
import io
import json

from bench.harness import free_port
from gateway.telemetry.cli import metrics_main
from tests.telemetry.telemetry_events import make_events, make_telemetry


def _populate(url: str, prefix: str) -> dict:
    async def go() -> dict:
        telemetry = make_telemetry(url, metrics_key_prefix=prefix, ttft_slo_tenants={"acme": 250.0})
        for event in make_events(seed=3, count=500) + make_events(seed=4, count=200, tenant="beta"):
            telemetry.record(event)
        await telemetry.writer.drain()
        everyone = await telemetry.report("*")
        await telemetry.aclose()
        return everyone

    return asyncio.run(go())


ENV = {"FIRSTTOKEN_TTFT_SLO_TENANTS": "acme:250"}


def test_json_matches_the_gateway_report(redis_url: str, key_prefix: str) -> None:
    expected = _populate(redis_url, key_prefix)
    out = io.StringIO()
    assert (
        metrics_main(
            ["--all", "--json", "--redis-url", redis_url, "--prefix", key_prefix],
            environ=ENV,
            out=out,
        )
        == 0
    )
    assert json.loads(out.getvalue()) == expected
    out = io.StringIO()
    env = {**ENV, "FIRSTTOKEN_REDIS_URL": redis_url, "FIRSTTOKEN_METRICS_KEY_PREFIX": key_prefix}
    assert metrics_main(["--tenant", "beta", "--json"], environ=env, out=out) == 0
    (beta,) = [t for t in expected["tenants"] if t["tenant"] == "beta"]
    assert json.loads(out.getvalue()) == beta
    assert beta["routes"][0]["slo"]["target_ms"] == 1000.0


def _tables(text: str) -> list[tuple[list[str], list[dict[str, str]]]]:
    """The printed tables (routes, then APIs, split by a blank line) as (header, rows by column
    name); every row has every column."""
    lines = text.splitlines()
    assert lines[-1].startswith("(times in ms")
    tables = []
    for part in "\n".join(lines[:-1]).split("\n\n"):
        header, *body = part.splitlines()
        rows = []
        for line in body:
            cells = line.split()
            assert len(cells) == len(header.split()), line
            rows.append(dict(zip(header.split(), cells, strict=True)))
        tables.append((header.split(), rows))
    return tables


def _table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """The route table."""
    return _tables(text)[0]


def test_table_has_one_aligned_column_per_figure(redis_url: str, key_prefix: str) -> None:
    expected = _populate(redis_url, key_prefix)
    out = io.StringIO()
    assert (
        metrics_main(["--redis-url", redis_url, "--prefix", key_prefix], environ=ENV, out=out) == 0
    )
    header, rows = _table(out.getvalue())
    assert header[:5] == ["tenant", "route", "count", "errors", "err%"]
    assert {"ttft_p50", "ttft_p99", "slo_ms", "slo_met"} <= set(header)
    assert len(rows) == 4
    for tenant in expected["tenants"]:
        for route in tenant["routes"]:
            (row,) = [
                r for r in rows if (r["tenant"], r["route"]) == (tenant["tenant"], route["route"])
            ]
            assert row["count"] == str(route["count"])
            assert row["errors"] == str(route["errors"]) != "0"
            assert row["err%"] == f"{route['errors'] / route['count']:.1%}"
            assert row["ttft_p50"] == f"{route['ttft_ms']['p50']:.1f}"
            assert row["slo_ms"] == f"{route['slo']['target_ms']:g}"
            assert row["slo_met"] == f"{route['slo']['attainment']:.2%}"
    # One row per tenant and API (all chat here), the same figures as the routes summed.
    api_header, api_rows = _tables(out.getvalue())[1]
    assert api_header == ["tenant", "api", *header[2:]]
    for tenant in expected["tenants"]:
        (row,) = [r for r in api_rows if r["tenant"] == tenant["tenant"]]
        (chat,) = tenant["by_api"]
        assert row["api"] == chat["api"] == "chat"
        assert row["count"] == str(chat["count"]) == str(sum(r["count"] for r in tenant["routes"]))
        assert row["ttft_p50"] == f"{chat['ttft_ms']['p50']:.1f}"
    # Figures are right-aligned: in every line each numeric column ends at the same place.
    lines = [line for line in out.getvalue().splitlines()[:-1] if line]
    ends = {len(line) for line in lines}
    assert len(ends) == 1
    count_end = lines[0].index("count") + len("count")
    assert all(line[count_end - 1].isalnum() and line[count_end] == " " for line in lines)


def test_errors_are_reported_with_exit_status(capsys) -> None:
    assert metrics_main([], environ={}) == 2
    assert "no Redis URL" in capsys.readouterr().err
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert metrics_main(["--redis-url", dead], environ={}) == 1
    assert "cannot read Redis" in capsys.readouterr().err
    assert metrics_main(["--redis-url", dead, "--window", "0"], environ={}) == 2
    bad = {"FIRSTTOKEN_TTFT_SLO_OBJECTIVE": "2"}  # read through the gateway's own settings
    assert metrics_main(["--redis-url", dead], environ=bad) == 2
    assert "FIRSTTOKEN_TTFT_SLO_OBJECTIVE" in capsys.readouterr().err
