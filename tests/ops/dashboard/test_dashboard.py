"""`/dashboard` in a real headless Chromium, against a gateway with recorded traffic.

Two tenants send requests through the gateway (and an hour of their earlier traffic is recorded
straight into its telemetry, with past timestamps, so the charts have a history). Tenant acme's
key is typed into the page: the charts must plot exactly the series JSON acme's key reads, and
nothing of tenant bravo may reach the page. Then the admin key: the tenant picker and the fleet
view appear. Screenshots go to `bench/results/` (not committed).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.mock_openai import MockBehaviour, MockUpstream, ThreadedServer
from gateway.telemetry.event import RequestEvent
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV, openai_route

pytestmark = pytest.mark.timeout(120)

ACME_KEY, BRAVO_KEY, ADMIN_KEY = "sk-acme-dash-1", "sk-bravo-dash-1", "sk-root-dash-1"
TENANT_KEYS = f"acme:{ACME_KEY},bravo:{BRAVO_KEY}"
BRAVO_ROUTE = "bravo-private-route"
SLO_MS = 250
RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"
WAIT_S = 20  # the longest any wait in the browser may take
WIDTH = 1440  # a laptop screen
PHONE = (390, 844)  # a phone held upright, in CSS pixels

# A system prompt above the 1,024-token minimum of prompt caching, so that the advisor counts
# the cached share each opt-in would reach.
SYSTEM = "You are the support agent of ACME Anvils. Answer briefly and cite the manual. " * 60
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} for the support agent",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    }
    for name in ("lookup_order", "refund_order", "track_parcel", "open_ticket")
]


@pytest.fixture
def second_replica():
    with ThreadedServer(MockUpstream(MockBehaviour(first_delay_s=0.005))) as server:
        yield server


def routes(mock_upstream, second_replica) -> list[dict]:
    return [
        openai_route(mock_upstream, models=["mock-*"]),
        openai_route(mock_upstream, name=BRAVO_ROUTE, models=["bravo-*"]),
        {
            "name": "fleet",
            "models": ["fleet-*"],
            "kind": "openai",
            "api_key_env": UPSTREAM_KEY_ENV,
            "replicas": [
                {"name": "r0", "base_url": mock_upstream.base_url},
                {"name": "r1", "base_url": second_replica.base_url},
            ],
        },
    ]


def send_traffic(gw) -> None:
    """Streams through the gateway: acme on `mock` (its tools in a new order each time, a break
    the advisor should name) and on `fleet`; bravo on its own route."""
    acme, bravo = sdk_client(gw, ACME_KEY), sdk_client(gw, BRAVO_KEY)
    shuffler = random.Random(7)
    for turn in range(6):
        tools = TOOLS[:]
        shuffler.shuffle(tools)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Where is order {turn}?"},
        ]
        list(
            acme.chat.completions.create(
                model="mock-1", messages=messages, tools=tools, stream=True
            )
        )
    for turn in range(3):
        messages = [{"role": "user", "content": f"fleet question {turn}"}]
        list(acme.chat.completions.create(model="fleet-1", messages=messages, stream=True))
    for turn in range(5):
        messages = [{"role": "user", "content": f"bravo question {turn}"}]
        list(bravo.chat.completions.create(model="bravo-1", messages=messages, stream=True))


def history(now: float) -> list[RequestEvent]:
    """Forty minutes of earlier traffic: acme on both its routes (a slow spell on `mock` in the
    middle, above the SLO), bravo on its own route with a count no acme figure has."""
    events = []
    for minutes_ago in range(45, 5, -1):
        ts = now - 60 * minutes_ago
        slow = 20 <= minutes_ago <= 25
        for route, model, n, ttft in (("mock", "mock-1", 3, 0.06), ("fleet", "fleet-1", 2, 0.12)):
            for i in range(n):
                seconds = ttft * (6 if slow and route == "mock" else 1) * (1 + 0.1 * i)
                events.append(
                    RequestEvent(
                        tenant="acme",
                        route=route,
                        model=model,
                        stream=True,
                        status="ok",
                        ttft_s=seconds,
                        upstream_ttft_s=seconds * 0.97,
                        total_s=seconds + 0.2,
                        output_tokens=40,
                        prompt_tokens=2000,
                        cached_prompt_tokens=(1536 if route == "mock" else 512)
                        if minutes_ago < 30
                        else 0,
                        prompt_tokens_saved=120 if route == "mock" else 0,
                        ts=ts,
                    )
                )
        events.extend(
            RequestEvent(
                tenant="bravo",
                route=BRAVO_ROUTE,
                model="bravo-1",
                stream=True,
                status="ok",
                ttft_s=0.9,
                upstream_ttft_s=0.85,
                total_s=1.1,
                prompt_tokens=777,
                ts=ts,
            )
            for _ in range(7)
        )
    return events


def record(gw, events: list[RequestEvent]) -> None:
    """Hand `events` to the gateway's telemetry on its own event loop, as requests do."""
    done = threading.Event()

    def on_loop() -> None:
        for event in events:
            gw.runtime.telemetry.record(event)
        done.set()

    gw.server.servers[0].get_loop().call_soon_threadsafe(on_loop)
    assert done.wait(10)


def get(gw, path: str, key: str, **params) -> dict:
    response = httpx.get(
        gw.url + path, params=params, headers={"authorization": f"Bearer {key}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def script(driver, code: str):
    return driver.execute_script(code)


def sign_in(driver, gw, key: str, updates_before: int = 0) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    field = wait.until(lambda d: d.find_element(By.ID, "key"))
    wait.until(lambda d: field.is_displayed())
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    return wait.until(
        lambda d: script(
            d,
            "const s = window.__dashboard;"
            f"return s && s.updates > {updates_before} && s.error === null"
            " && s.charts.ttft ? s : null;",
        )
    )


def by_time(points: list[dict], figure: str, quantile: str | None = None) -> dict[int, float]:
    out = {}
    for p in points:
        value = p[figure]
        if quantile is not None and value is not None:
            value = value[quantile]
        if p["count"] and value is not None:
            out[p["t"]] = value
    return out


def plotted(chart: dict, label: str) -> dict[int, float]:
    column = chart["labels"].index(label) + 1
    return {
        t: v for t, v in zip(chart["data"][0], chart["data"][column], strict=True) if v is not None
    }


def assert_close(shown: dict[int, float], expected: dict[int, float], scale: float = 1.0):
    assert len(expected) >= 30, expected  # the recorded history is on the chart
    common = shown.keys() & expected.keys()
    # A refresh that crossed a minute boundary may lack the newest step, nothing else.
    assert len(common) >= len(expected) - 1, (sorted(shown), sorted(expected))
    for t in common:
        assert shown[t] == pytest.approx(expected[t] * scale, rel=1e-6), t


def screenshot(driver, name: str) -> None:
    """The whole page at a laptop's width, into `bench/results/NAME`."""
    height = script(driver, "return document.documentElement.scrollHeight")
    metrics = {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    RESULTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(RESULTS / name))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def page_headers(gw) -> httpx.Response:
    page = httpx.get(gw.url + "/dashboard", timeout=10)
    assert page.status_code == 200
    return page


def test_dashboard_in_headless_chromium(browser, make_gateway, mock_upstream, second_replica):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    mock_upstream.mock.behaviour.first_delay_s = 0.02
    gw = make_gateway(
        routes(mock_upstream, second_replica),
        tenant_keys=TENANT_KEYS,
        admin_keys=ADMIN_KEY,
        ttft_slo_ms=SLO_MS,
    )
    gw.wait_ready()
    send_traffic(gw)
    record(gw, history(time.time()))
    wait_for(
        lambda: sum(r["count"] for r in get(gw, "/v1/metrics/ttft", ACME_KEY)["routes"]) >= 9 + 200,
        "acme's requests in the metrics",
    )
    wait_for(
        lambda: get(gw, "/v1/metrics/cache-advice", ACME_KEY)["families"],
        "the advisor's first family",
    )

    # The page itself: a strict policy, no inline script, long-cached versioned assets.
    page = page_headers(gw)
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy
    assert "<script>" not in page.text and "unsafe-inline" not in policy

    browser.get(gw.url + "/dashboard")
    shown = sign_in(browser, gw, ACME_KEY)
    window, step = shown["window_s"], shown["step_s"]
    series = get(gw, "/v1/metrics/ttft/series", ACME_KEY, window=window, step=step)
    assert shown["who"] == {"tenant": "acme", "admin": False, "open": False}
    assert sorted(shown["routes"]) == sorted(series["routes"]) == ["fleet", "mock"]

    # The charts hold the JSON's figures, step by step.
    per_route = {
        route: get(gw, "/v1/metrics/ttft/series", ACME_KEY, window=window, step=step, route=route)
        for route in series["routes"]
    }
    charts = shown["charts"]
    for route, answer in per_route.items():
        points = answer["points"]
        assert_close(plotted(charts["ttft"], f"{route} p50"), by_time(points, "ttft_ms", "p50"))
        assert_close(plotted(charts["ttft"], f"{route} p99"), by_time(points, "ttft_ms", "p99"))
        assert_close(plotted(charts["cached"], route), by_time(points, "cached_share"), scale=100)
        assert_close(plotted(charts["saved"], route), by_time(points, "prompt_tokens_saved"))
    slo_line = plotted(charts["ttft"], f"SLO {SLO_MS} ms")
    assert set(slo_line.values()) == {SLO_MS} and series["slo_ms"] == SLO_MS
    assert_close(
        plotted(charts["split"], "upstream p50"),
        by_time(series["points"], "upstream_ttft_ms", "p50"),
    )
    assert_close(
        plotted(charts["slo"], "attainment"), by_time(series["points"], "slo_attainment"), 100
    )
    # The slow spell on `mock` (6x its usual TTFT, above the SLO) shows as missed steps.
    assert min(plotted(charts["slo"], "attainment").values()) < 100

    # The canvases were drawn (not blank) for every chart.
    for chart_id in ("ttft", "split", "cached", "saved", "slo"):
        inked = script(
            browser,
            f"const c = document.querySelector('#chart-{chart_id} canvas');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;",
        )
        assert inked > 1000, chart_id

    # Routes table, advice and prefix breaks, from acme's own JSON.
    table = {row["route"]: row for row in shown["tables"]["routes"]}
    report = get(gw, "/v1/metrics/ttft", ACME_KEY, window=window)
    assert {r["route"]: r["count"] for r in report["routes"]} == {
        route: row["count"] for route, row in table.items()
    }
    advice = get(gw, "/v1/metrics/cache-advice", ACME_KEY, window=window)
    assert shown["advice"] == [family["advice"] for family in advice["families"]]
    # one line per family with an opt-in to turn on, one summary line for the rest
    texts = [family["advice"] for family in advice["families"]]
    actionable = [t for t in texts if t.startswith("turn on")]
    quiet = {t for t in texts if not t.startswith("turn on")}
    assert len(shown["advice_lines"]) == len(actionable) + len(quiet)
    assert all(any(line.startswith(q) for line in shown["advice_lines"]) for q in quiet)
    breaks = {row["kind"]: row for row in shown["tables"]["breaks"]}
    assert "tools(order)" in breaks, breaks
    assert "FIRSTTOKEN_CANONICALIZE_SORT_TOOLS" in breaks["tools(order)"]["fix"]
    page_text = browser.find_element(By.TAG_NAME, "body").text
    assert "FIRSTTOKEN_CANONICALIZE_SORT_TOOLS" in page_text

    # Nothing of bravo: not its name, its route, or its figures; no fleet view for a tenant.
    everything = browser.page_source + script(browser, "return JSON.stringify(window.__dashboard)")
    assert "bravo" not in everything and BRAVO_ROUTE not in everything
    bravo = get(gw, "/v1/metrics/ttft", ADMIN_KEY, window=window, tenant="bravo")
    bravo_count = sum(r["count"] for r in bravo["routes"])
    assert bravo_count == 5 + 40 * 7 and f"{bravo_count:,}" not in page_text
    assert not browser.find_element(By.ID, "fleet-card").is_displayed()
    assert not browser.find_element(By.ID, "tenant-picker-label").is_displayed()
    # The key is in the tab's session storage only, never in the URL or local storage.
    assert script(browser, "return sessionStorage.getItem('firsttoken.dashboard.key')") == ACME_KEY
    assert script(browser, "return localStorage.length") == 0
    assert ACME_KEY not in browser.current_url
    screenshot(browser, "dashboard.png")

    # Auto-refresh without reloading: the page keeps its state and counts another update.
    marker = script(browser, "window.__marker = 1; return window.__dashboard.updates")
    Select(browser.find_element(By.ID, "refresh")).select_by_value("5")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: script(d, "return window.__dashboard.updates") >= marker + 2
    )
    assert script(browser, "return window.__marker") == 1

    # The admin: a tenant picker (every tenant and '*') and the fleet view.
    browser.find_element(By.ID, "sign-out").click()
    shown = sign_in(browser, gw, ADMIN_KEY)
    assert shown["who"]["admin"] is True and shown["tenant"] == "*"
    picker = Select(browser.find_element(By.ID, "tenant-picker"))
    assert {"*", "acme", "bravo"} <= {o.get_attribute("value") for o in picker.options}
    assert browser.find_element(By.ID, "tenant-picker-label").is_displayed()
    fleet = browser.find_element(By.ID, "fleet-card")
    assert fleet.is_displayed()
    replicas = shown["fleet"]["fleet"]["replicas"]
    assert {r["name"] for r in replicas} == {"r0", "r1"}
    assert sum(r["requests"] for r in replicas) == 3
    assert "r0" in fleet.text and "r1" in fleet.text and "hedges sent" in fleet.text
    all_rows = {(r["tenant"], r["route"]) for r in shown["tables"]["routes"]}
    assert ("bravo", BRAVO_ROUTE) in all_rows and ("acme", "mock") in all_rows
    screenshot(browser, "dashboard-admin.png")

    updates = shown["updates"]
    picker.select_by_value("bravo")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: script(
            d,
            f"const s = window.__dashboard; return s.updates > {updates} && s.tenant === 'bravo'",
        )
    )
    assert script(browser, "return window.__dashboard.routes") == [BRAVO_ROUTE]

    # No script error and no Content-Security-Policy violation in the console.
    problems = [
        entry["message"]
        for entry in browser.get_log("browser")
        if entry["level"] == "SEVERE" or "Content Security Policy" in entry["message"]
    ]
    assert problems == []


def fits(driver) -> dict:
    """How wide the page is against its viewport, and each table box against its table."""
    return script(
        driver,
        "return {page: document.documentElement.scrollWidth, viewport: window.innerWidth,"
        " boxes: Array.from(document.querySelectorAll('.table-scroll')).map((b) =>"
        " [b.querySelector('table').id, b.scrollWidth, b.clientWidth])};",
    )


def test_dashboard_fits_a_laptop_and_a_phone(browser, make_gateway, mock_upstream, second_replica):
    """The admin's view (the widest: a tenant column, the fleet tables) at a laptop's size and
    at a phone's: the page never scrolls sideways (a table scrolls inside its card), the error
    budget reads as a bounded figure, and the upstream-vs-gateway stack starts at 0."""
    gw = make_gateway(
        routes(mock_upstream, second_replica),
        tenant_keys=TENANT_KEYS,
        admin_keys=ADMIN_KEY,
        ttft_slo_ms=SLO_MS,
    )
    gw.wait_ready()
    send_traffic(gw)
    record(gw, history(time.time()))
    wait_for(
        lambda: get(gw, "/v1/metrics/cache-advice", ACME_KEY)["families"],
        "the advisor's first family",
    )
    browser.get(gw.url + "/dashboard")
    shown = sign_in(browser, gw, ADMIN_KEY)
    for name, (width, height), mobile in (
        ("dashboard-laptop.png", (WIDTH, 900), False),
        ("dashboard-phone.png", PHONE, True),
    ):
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        browser.refresh()  # signs in again from the tab's session storage, at this size
        shown = wait_for(
            lambda: script(
                browser,
                "const s = window.__dashboard; return s.updates > 0 && s.error === null"
                " && s.fleet && s.charts.split && s.charts.split.y_range ? s : null;",
            ),
            f"the board at {width}x{height}",
            WAIT_S,
        )
        measured = fits(browser)
        assert measured["viewport"] == width
        assert measured["page"] <= measured["viewport"], (name, measured)
        if mobile:  # the routes table is wider than a phone: it scrolls inside its card
            routes_box = next(b for b in measured["boxes"] if b[0] == "routes-table")
            assert routes_box[1] > routes_box[2], measured
        assert shown["charts"]["split"]["y_range"][0] == 0
        budgets = [row["budget"] for row in shown["tables"]["routes"]]
        assert not any(b.startswith(("-", "\N{MINUS SIGN}")) for b in budgets), budgets
        over = "over budget \N{MULTIPLICATION SIGN}"
        assert any(b.startswith(over) for b in budgets), budgets  # mock's slow spell
        RESULTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(RESULTS / name.replace(".png", "-first-screen.png")))
        full = script(browser, "return document.documentElement.scrollHeight")
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride", {**metrics, "height": max(height, full)}
        )
        browser.save_screenshot(str(RESULTS / name))
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
