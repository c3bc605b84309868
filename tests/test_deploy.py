"""The files in `deploy/` against the gateway they describe: the Grafana dashboard imports as it
is and every PromQL query in it names series (and labels) that a real gateway's `/metrics`
exposes; the Prometheus config scrapes `/metrics` with the admin key.

Names are checked against the scraped *sample* names (`firsttoken_ttft_seconds_bucket`,
`firsttoken_hedges_total`), not family names, because that is what PromQL selects: a query on
a family name without its `_total` or `_bucket` would draw an empty panel. No Grafana server is
needed: the dashboard is parsed here."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import free_port
from bench.mock_openai import MockUpstream, ThreadedServer
from tests.support.clients import sdk_client
from tests.support.gateway import UPSTREAM_KEY_ENV, openai_route

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "firsttoken.json").read_text())
ADMIN_KEY = "root-key"
TENANT_KEY = "key-a"

# PromQL functions and aggregations the dashboard may call; an identifier followed by `(` that
# is not here is a typo (or a metric written as a call).
FUNCTIONS = frozenset(
    "sum min max avg count stddev stdvar topk bottomk quantile count_values group "
    "rate irate increase delta idelta deriv histogram_quantile scalar vector clamp_min clamp_max "
    "abs ceil floor round sqrt exp ln log2 log10 time timestamp absent absent_over_time "
    "avg_over_time max_over_time min_over_time sum_over_time count_over_time "
    "quantile_over_time last_over_time label_replace label_join sort sort_desc".split()
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})
GRAFANA_BUILTINS = frozenset({"__range", "__rate_interval", "__interval", "__range_s"})

TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<range>\[[^\]]*\])
    | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    | (?P<variable>\$\{?\w+\}?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){},])
    )""",
    re.VERBOSE,
)


class Query:
    """What one PromQL expression uses: metric names with the label names each selector matches
    on, the label names it groups or matches by, and the `$variables` it references."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.selectors: list[tuple[str, set[str]]] = []
        self.grouping: set[str] = set()
        self.variables = set(re.findall(r"\$\{?(\w+)\}?", expr))
        tokens = self._tokens(expr)
        i = 0
        while i < len(tokens):
            kind, text = tokens[i]
            following = tokens[i + 1][1] if i + 1 < len(tokens) else None
            if kind != "ident":
                assert text != "{", f"a selector without a metric name in {expr!r}"
                i += 1
            elif text in GROUPING:
                i = self._label_list(tokens, i + 1) if following == "(" else i + 1
            elif following == "(" or (text in FUNCTIONS and following in ("by", "without")):
                assert text in FUNCTIONS, f"unknown function {text!r} in {expr!r}"
                i += 1
            elif text in KEYWORDS:
                i += 1
            else:
                i = self._selector(tokens, i)

    @staticmethod
    def _tokens(expr: str) -> list[tuple[str, str]]:
        tokens, pos = [], 0
        while pos < len(expr.rstrip()):
            match = TOKEN.match(expr, pos)
            assert match and match.end() > pos, f"cannot parse {expr[pos:]!r}"
            kind = match.lastgroup
            assert kind is not None
            tokens.append((kind, match.group(kind)))
            pos = match.end()
        return tokens

    def _label_list(self, tokens: list[tuple[str, str]], i: int) -> int:
        i += 1  # past "("
        while tokens[i][1] != ")":
            if tokens[i][0] == "ident":
                self.grouping.add(tokens[i][1])
            i += 1
        return i + 1

    def _selector(self, tokens: list[tuple[str, str]], i: int) -> int:
        name, labels = tokens[i][1], set()
        i += 1
        if i < len(tokens) and tokens[i][1] == "{":
            i += 1
            while tokens[i][1] != "}":
                kind, text = tokens[i]
                if kind == "ident":
                    assert tokens[i + 1][0] == "op" and tokens[i + 2][0] == "string", (
                        f"bad matcher at {text!r} in {self.expr!r}"
                    )
                    labels.add(text)
                    i += 3
                else:
                    i += 1
            i += 1
        self.selectors.append((name, labels))
        return i

    @property
    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}


def graph_panels() -> list[dict]:
    """Every panel that queries, rows' nested panels included."""
    found = []
    for panel in DASHBOARD["panels"]:
        found.extend(panel.get("panels", []))
        if panel["type"] != "row":
            found.append(panel)
    return found


def all_queries() -> list[tuple[str, Query]]:
    """(where, query) for every target's expression and every `label_values` variable query."""
    queries = [
        (f"panel {p['id']} {p['title']!r} {t['refId']}", Query(t["expr"]))
        for p in graph_panels()
        for t in p["targets"]
    ]
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert match, f"variable {var['name']}: expected label_values(selector, label)"
            query = Query(match.group(1))
            query.grouping.add(match.group(2))  # the label the variable lists must exist
            queries.append((f"variable {var['name']}", query))
    return queries


# ---------------------------------------------------------------- the dashboard's shape


def test_query_parser_finds_metrics_labels_and_variables():
    query = Query(
        'histogram_quantile(0.99, sum by (le, tenant) (rate(a_bucket{route=~"$route"}[$window])))'
        " / scalar(sum(rate(b_total[5m])))"
    )
    assert query.selectors == [("a_bucket", {"route"}), ("b_total", set())]
    assert query.grouping == {"le", "tenant"} and query.variables == {"route", "window"}
    with pytest.raises(AssertionError, match="unknown function"):
        Query("sum(rat(a_total[5m]))")


def test_dashboard_has_an_importable_shape():
    assert DASHBOARD["id"] is None, "an exported id would overwrite another dashboard on import"
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    ids = [p["id"] for p in DASHBOARD["panels"]] + [
        n["id"] for p in DASHBOARD["panels"] for n in p.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in "hwxy") and pos["w"] > 0 and pos["h"] > 0
        assert pos["x"] + pos["w"] <= 24, f"panel {panel['id']} runs off the 24-column grid"
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"panel {panel['id']} overlaps another"
        cells |= mine
    for panel in graph_panels():
        assert panel["targets"], f"panel {panel['id']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        assert all(t["expr"].strip() for t in panel["targets"])


def test_every_datasource_reference_resolves_on_import():
    """Panels name the Prometheus data source through a variable that import resolves: a
    `datasource` template variable (or an `__inputs` entry, as Grafana's export writes it)."""
    resolvable = {
        v["name"]
        for v in DASHBOARD["templating"]["list"]
        if v["type"] == "datasource" and v["query"] == "prometheus"
    } | {i["name"] for i in DASHBOARD.get("__inputs", []) if i.get("pluginId") == "prometheus"}
    assert resolvable
    refs = [p["datasource"] for p in graph_panels()]
    refs += [t["datasource"] for p in graph_panels() for t in p["targets"]]
    refs += [v["datasource"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    for ref in refs:
        assert ref["type"] == "prometheus"
        uid = re.fullmatch(r"\$\{(\w+)\}", ref["uid"])
        assert uid and uid.group(1) in resolvable, ref


def test_queries_reference_only_defined_variables():
    defined = {v["name"] for v in DASHBOARD["templating"]["list"]} | GRAFANA_BUILTINS
    for where, query in all_queries():
        assert query.variables <= defined, (where, query.variables - defined)
    used = set().union(*(q.variables for _, q in all_queries()))
    assert {"tenant", "route", "api", "window"} <= used


def test_dashboard_covers_the_gateways_story():
    metrics = set().union(*(q.metrics for _, q in all_queries()))
    expected = {
        "firsttoken_ttft_seconds_bucket",
        "firsttoken_upstream_ttft_seconds_bucket",
        "firsttoken_gateway_seconds_bucket",
        "firsttoken_requests_total",
        "firsttoken_errors_total",
        "firsttoken_cached_prompt_tokens_total",
        "firsttoken_prompt_tokens_total",
        "firsttoken_prompt_tokens_saved_total",
        "firsttoken_prefix_breaks_total",
        "firsttoken_hedges_total",
        "firsttoken_replica_healthy",
        "firsttoken_replica_in_flight",
        "firsttoken_replica_ejections_total",
        "firsttoken_replica_affinity_hits_total",
    }
    assert expected <= metrics, expected - metrics
    quantiles = [
        q.expr
        for _, q in all_queries()
        if "firsttoken_ttft_seconds_bucket" in q.metrics and {"tenant", "route"} <= q.grouping
    ]
    assert {re.search(r"histogram_quantile\(([\d.]+)", e).group(1) for e in quantiles} >= {
        "0.5",
        "0.9",
        "0.99",
    }


# ---------------------------------------------------------------- against a real gateway


@pytest.fixture
def exported(mock_upstream, make_gateway) -> dict[str, set[str]]:
    """Sample name -> label names, scraped from a gateway that served a little of everything:
    streams with cached tokens and slimmed prompts, a prefix break, an upstream error, a
    fallback, and a replicated route whose slow replica gets hedged."""
    with ExitStack() as stack:
        replicas = [stack.enter_context(ThreadedServer(MockUpstream())) for _ in range(2)]
        replicas[0].mock.behaviour.first_delay_s = 1.0
        fleet = {
            "name": "fleet",
            "models": ["fleet-*"],
            "kind": "openai",
            "api_key_env": UPSTREAM_KEY_ENV,
            "replicas": [{"name": f"r{i}", "base_url": s.base_url} for i, s in enumerate(replicas)],
            "hedge_after_ms": 100,
            "hedge_max_ratio": 1.0,
            "balance": "round_robin",
        }
        dead = {
            "name": "dead",
            "models": ["spare-*"],
            "kind": "openai",
            "base_url": f"http://127.0.0.1:{free_port()}/v1",
            "fallbacks": ["mock"],
        }
        mock_upstream.mock.behaviour.cached_tokens = 4
        gw = make_gateway(
            [openai_route(mock_upstream), fleet, dead],
            tenant_keys=f"acme:{TENANT_KEY}",
            admin_keys=ADMIN_KEY,
        )
        client = sdk_client(gw, TENANT_KEY)
        for i in range(2):  # round robin: one of the two starts on the slow replica
            list(
                client.chat.completions.create(
                    model="fleet-1", stream=True, messages=[{"role": "user", "content": f"q{i}"}]
                )
            )
        rules = "Rules of the house. " * 200
        for clock in ("12:00:00", "12:01:07"):  # the second one breaks the prefix
            system = rules[:1000] + f"Time: {clock}.   \n\n\n\n\u200b" + rules[1000:]
            list(
                client.chat.completions.create(
                    model="mock-1",
                    stream=True,
                    messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": "hi"},
                    ],
                )
            )
        client.chat.completions.create(model="spare-1", messages=[{"role": "user", "content": "x"}])
        mock_upstream.mock.behaviour.fail_statuses = [400]
        failed = httpx.post(
            gw.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {TENANT_KEY}"},
            json={"model": "mock-1", "messages": [{"role": "user", "content": "x"}]},
            timeout=20,
        )
        assert failed.status_code == 400
        scrape = httpx.get(
            gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=20
        )
        assert scrape.status_code == 200
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(scrape.text):
        for sample in family.samples:
            labels[sample.name] |= set(sample.labels)
    return dict(labels)


def test_every_query_names_series_and_labels_the_gateway_exports(exported):
    assert exported["firsttoken_hedges_total"] == {"route", "outcome"}  # the traffic hedged
    for where, query in all_queries():
        for name, matched in query.selectors:
            assert name in exported, f"{where}: {name} is not exported by the gateway"
            assert matched <= exported[name], (where, name, matched - exported[name])
        for name in query.metrics:
            missing = query.grouping - exported[name]
            assert not missing, f"{where}: {name} has no label {sorted(missing)}"


def test_exporter_renames_would_be_caught(exported):
    """The check above has teeth: a family name without its suffix is not a sample name."""
    assert "firsttoken_ttft_seconds" not in exported
    assert "firsttoken_hedges" not in exported
    assert "le" not in exported["firsttoken_ttft_seconds_count"]


# ---------------------------------------------------------------- the Prometheus config


def test_prometheus_scrapes_metrics_with_the_admin_key_as_bearer():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extras (transformers)")
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["firsttoken"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    auth = job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer" and auth["credentials_file"].startswith("/")
    assert "credentials" not in auth, "the key belongs in a file, not in the config"
    interval = job.get("scrape_interval", config["global"]["scrape_interval"])
    seconds = int(re.fullmatch(r"(\d+)s", interval).group(1))
    assert 5 <= seconds <= 60
    timeout = job.get("scrape_timeout", config["global"].get("scrape_timeout", "10s"))
    assert int(re.fullmatch(r"(\d+)s", timeout).group(1)) <= seconds
    assert all(":" in target for sc in job["static_configs"] for target in sc["targets"])


@pytest.fixture
def before_any_error(mock_upstream, make_gateway) -> set[str]:
    """The sample names of a gateway that has served one ok request and no error yet."""
    gw = make_gateway([openai_route(mock_upstream)], admin_keys=ADMIN_KEY)
    sdk_client(gw).chat.completions.create(
        model="mock-1", messages=[{"role": "user", "content": "x"}]
    )
    scrape = httpx.get(
        gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=20
    )
    return {s.name for f in text_string_to_metric_families(scrape.text) for s in f.samples}


def test_stat_panels_show_zero_not_no_data_before_their_first_event(before_any_error):
    """A stat over a counter that appears only with its first event (errors appear with the
    first error, TTFT counts with the first stream) reads 0 until then: such a counter is summed
    `or vector(0)`. Where the figure is undefined without data (a quantile, a ratio whose
    denominator is absent too), "No data" is the truth and stays."""
    assert "firsttoken_errors_total" not in before_any_error  # the case this guards
    stats = [p for p in DASHBOARD["panels"] if p.get("type") == "stat"]
    assert any(p["title"] == "Error ratio" for p in stats)
    for panel in stats:
        for target in panel["targets"]:
            expr = target["expr"]
            if "histogram_quantile" in expr:
                continue
            numerator, _, denominator = expr.partition(" / ")
            if any(name not in before_any_error for name, _ in Query(denominator).selectors):
                continue
            for name, _ in Query(numerator).selectors:
                if name in before_any_error:
                    continue
                summed = re.search(
                    rf"\(sum\(increase\({name}\{{[^}}]*\}}\[[^\]]*\]\)\) or vector\(0\)\)",
                    expr,
                )
                assert summed, f"panel {panel['title']!r}: {name} is 'No data' until it appears"
