import asyncio
import io
import json

from gateway.telemetry import Telemetry
from gateway.telemetry.cli import metrics_main
from tests.local_servers import free_port
from tests.telemetry.telemetry_events import make_events


def _populate(url: str, prefix: str) -> dict:
    async def go() -> dict:
        telemetry = Telemetry.create(redis_url=url, key_prefix=prefix, slo_tenants={"acme": 250.0})
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


def test_table_lists_each_tenant_and_route(redis_url: str, key_prefix: str) -> None:
    expected = _populate(redis_url, key_prefix)
    out = io.StringIO()
    assert (
        metrics_main(["--redis-url", redis_url, "--prefix", key_prefix], environ=ENV, out=out) == 0
    )
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:4] == ["tenant", "route", "count", "ttft"]
    rows = [line.split() for line in lines[1:-1]]
    assert len(rows) == 4
    for tenant in expected["tenants"]:
        for route in tenant["routes"]:
            (row,) = [r for r in rows if r[:2] == [tenant["tenant"], route["route"]]]
            assert row[2] == str(route["count"])
            assert row[3] == f"{route['ttft_ms']['p50']:.1f}"
            assert row[9].startswith(f"{route['slo']['attainment']:.2%}")


def test_errors_are_reported_with_exit_status(capsys) -> None:
    assert metrics_main([], environ={}) == 2
    assert "no Redis URL" in capsys.readouterr().err
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert metrics_main(["--redis-url", dead], environ={}) == 1
    assert "cannot read Redis" in capsys.readouterr().err
    assert metrics_main(["--redis-url", dead, "--window", "0"], environ={}) == 2
