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


def samples(port: int, name: str) -> dict[str, float]:
    """The values of counter `name` on a live /metrics, by their `result` label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_the_token_hit_ratio_panel_is_filled_by_worker_lookups(tmp_path):
    """A worker's lookup says how many tokens a key stands for: the agent counts the whole
    prompt's tokens, and passes the number on to the metadata service with the keys its own
    tiers lack, so both of the panel's series have data (they were always empty before)."""
    from kvstore.client import KVStoreClient
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.metadata.client import MetadataClient
    from kvstore.metadata.records import BlockEntry, NodeRecord

    [panel] = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["id"] == 2]
    used = set().union(*(metric_names(target["expr"]) for target in panel["targets"]))
    assert used == {"kvstore_agent_lookup_tokens_total", "kvstore_metadata_lookup_tokens_total"}
    keys = chunk_keys(Namespace("sha256:model", "layout"), range(64 * 4), 64)
    with running_server(tmp_path, metrics_listen="127.0.0.1:0") as server:
        address = f"127.0.0.1:{server.port}"
        with MetadataClient(address) as other_node:  # holds keys 1 and 2
            lease, _ = other_node.register_node(NodeRecord("node-b", tcp_address="127.0.0.1:1"))
            entries = [BlockEntry(bytes(key), "host", 1000, 1) for key in keys[1:3]]
            other_node.publish("node-b", lease, "t", entries)
            with running_agent(
                tmp_path,
                metadata_address=address,
                transfer="tcp",
                metrics_listen="127.0.0.1:0",
                view_max_keys=0,  # every remote lookup asks the service
            ) as agent:
                assert wait_until(lambda: agent.link.connected)
                with KVStoreClient(agent.config.socket_path, "worker") as worker:
                    reservation = worker.save("t", keys[:1], 1000)
                    assert worker.commit(reservation) == 1
                    found = worker.lookup("t", keys, chunk_tokens=64)
                assert (found.local, found.remote) == (1, 2)
                at_agent = samples(agent.metrics_port, "kvstore_agent_lookup_tokens_total")
                at_service = samples(server.metrics_port, "kvstore_metadata_lookup_tokens_total")
    assert at_agent == {"asked": 256, "local_hit": 64, "remote_hit": 128}
    assert at_service == {"asked": 192, "hit": 128}
