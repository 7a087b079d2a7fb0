"""The Grafana dashboard names only metrics kvstore exports: a real metadata service and a real
node agent (in-process, registered with each other) are scraped, and every PromQL expression's
metric names are checked against what they serve. The chart provisions the same file."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.tools import CHART, DEPLOY, render
from tests.metadata.servers import running_server, wait_until
from tests.node.agents import running_agent

DASHBOARD = DEPLOY / "grafana" / "kvstore.json"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
}
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "le",
    "inf",
    "nan",
}


def scrape(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    tmp_path = tmp_path_factory.mktemp("metrics")
    with running_server(tmp_path, metrics_listen="127.0.0.1:0") as server:
        with running_agent(
            tmp_path,
            metadata_address=f"127.0.0.1:{server.port}",
            transfer="tcp",
            metrics_listen="127.0.0.1:0",
            disk_dir=tmp_path / "disk",
            disk_capacity_bytes=32 << 20,
        ) as agent:
            assert wait_until(lambda: agent.link.connected)
            return scrape(server.metrics_port) | scrape(agent.metrics_port)


def expressions(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(
                variable["query"]
                if isinstance(variable["query"], str)
                else variable["query"]["query"]
            )
    return found


def metric_names(expr: str) -> set[str]:
    """Identifiers of an expression that are neither functions, keywords, label matchers,
    grouping labels, ranges, strings nor dashboard variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    text = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", "", text)
    names = set()
    for word in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        is_function = text[word.end() :].lstrip().startswith("(")
        if not is_function and word[0] not in PROMQL_WORDS:
            names.add(word[0])
    return names


def test_the_metric_name_parser_sees_through_promql():
    expr = 'histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{m="x"}[5m]))) / b_total'
    assert metric_names(expr) == {"a_bucket", "b_total"}


def test_every_expression_names_only_exported_metrics(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    assert not metric_names("rate(kvstore_agent_bogus_total[5m])") <= exported
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{sorted(names - exported)} not exported; used in {expr!r}"


def test_the_dashboard_covers_what_operators_watch():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "hit ratio",
        "lookups/s",
        "latency",
        "gb/s",
        "capacity",
        "evictions",
        "checksum",
        "nodes alive",
        "transfer",
    ):
        assert topic in titles, topic
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)


def test_the_chart_provisions_the_same_dashboard_for_grafanas_sidecar():
    maps = [
        o
        for o in render()
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")
    ]
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["kvstore.json"]) == json.loads(DASHBOARD.read_text())
    assert (CHART / "dashboards" / "kvstore.json").resolve() == DASHBOARD.resolve()
