"""The chart rendered with values a user would write (issue 32): what a user sets reaches the
pods, and what would break a pod at run time (a negative size, a memory limit the arena does not
fit in) is refused at `helm template` with a message that says what to change."""

from __future__ import annotations

import json

import pytest
import yaml

from kvstore.block import HEADER_BYTES
from kvstore.layout import KVLayout
from tests.deploy.tools import BAD_VALUES, CHART, helm_template, pod_spec, render

SIDECAR = CHART / "ci" / "sidecar-values.yaml"
MONITORING = ("--api-versions", "monitoring.coreos.com/v1")
GPU_NODES = {"nvidia.com/gpu.present": "true"}


def component_of(obj: dict) -> str | None:
    if obj["kind"] not in ("Deployment", "DaemonSet"):
        return None
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment(rendered: list[dict], component: str) -> dict:
    [obj] = [o for o in rendered if component_of(o) == component]
    return obj


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def sglang_args(*values: str) -> list[str]:
    spec = pod_spec(deployment(render(SIDECAR, *values), "sglang"))
    return spec["containers"][0]["args"]


def test_the_sglang_example_passes_its_tenant():
    """The vLLM example always passed its tenant; the SGLang one dropped it (every engine
    then read and wrote the tenant `default`)."""
    from kvstore.connectors.sglang.config import BackendSettings

    args = sglang_args("--set", "sidecar.examples.sglang.tenant=team-a")
    extra = json.loads(flag(args, "--hicache-storage-backend-extra-config"))
    assert extra["tenant"] == "team-a"
    assert BackendSettings.from_extra_config(extra).tenant == "team-a"


def test_the_sglang_example_pages_fill_the_agents_pages():
    """SGLang's default page on CUDA is one token: every stored block would hold one token.
    The example sets --page-size; by default its pages are the agent's (node.pageSizeBytes, a
    256-token chunk of Llama-3-8B in bf16, all 8 kv heads on one GPU) with nothing to spare."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    page_tokens = defaults["sidecar"]["examples"]["sglang"]["pageSize"]
    assert flag(sglang_args(), "--page-size") == str(page_tokens)
    llama_3_8b = KVLayout(32, 8, 128, "bfloat16", chunk_tokens=page_tokens)
    assert llama_3_8b.payload_bytes + HEADER_BYTES == defaults["node"]["pageSizeBytes"]
    assert flag(sglang_args("--set", "sidecar.examples.sglang.pageSize=64"), "--page-size") == "64"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("negative-memory", "at '/node/resources/limits/memory': '-1Gi' does not match pattern"),
        ("negative-cpu", "at '/metadata/resources/requests/cpu': minimum: got -1, want 0"),
        ("memory-in-millibytes", "at '/sidecar/examples/sglang/resources/limits/memory'"),
        ("negative-gpu", "at '/node/rdma/resources/rdma~1hca': minimum: got -1, want 0"),
    ],
)
def test_a_negative_or_malformed_resource_is_refused(bad, message):
    result = helm_template(BAD_VALUES / f"{bad}.yaml", check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_quantities_kubernetes_accepts_pass_the_schema():
    resources = {
        "requests": {"cpu": 0.5, "memory": "1.5Gi"},
        "limits": {"cpu": "1500m", "memory": 2147483648},
    }
    rendered = render(None, "--set-json", f"metadata.resources={json.dumps(resources)}")
    [metadata] = [o for o in rendered if o["kind"] == "StatefulSet"]
    resources = pod_spec(metadata)["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": 0.5, "memory": "1.5Gi"}


def limit(section: str, memory: str, *values: str):
    values_file = SIDECAR if section == "sidecar" else None
    memory_limit = f"{section}.resources.limits.memory={memory}"
    return helm_template(values_file, *values, "--set", memory_limit, check=False)


@pytest.mark.parametrize(
    ("memory", "fits"),
    [
        ("8Gi", False),  # the values: an arena of 64Gi
        ("68Gi", True),  # hostCapacity 64Gi + memoryOverhead 4Gi
        ("69632Mi", True),
        ("71303168Ki", True),
        ("73014444032", True),  # plain bytes: 68Gi
        ("73014444031", False),
        ("75G", True),  # 75e9 bytes: 69.8Gi
        ("70G", False),  # 65.2Gi: decimal units are smaller
        ("69000M", False),
        ("0.1Ti", True),  # 102.4Gi
    ],
)
def test_a_memory_limit_the_arena_does_not_fit_in_is_refused(memory, fits):
    """The arena is shared memory, counted against the agent's memory limit: below the arena
    (plus the agent's own memoryOverhead) the agent is OOM-killed as the arena fills."""
    result = limit("node", memory)
    assert (result.returncode == 0) == fits, result.stderr
    if not fits:
        assert f"node.resources.limits.memory {memory} is below" in result.stderr
        assert "node.hostCapacity 64Gi" in result.stderr and "OOM-killed" in result.stderr


def test_a_sidecar_memory_limit_below_its_arena_is_refused():
    result = limit("sidecar", "16Gi")  # sidecar-values.yaml: an arena of 32Gi
    assert result.returncode != 0
    assert "sidecar.resources.limits.memory 16Gi is below" in result.stderr
    assert limit("sidecar", "34Gi").returncode == 0


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn) against labels."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        inside = labels.get(expression["key"]) in expression["values"]
        if inside != (expression["operator"] == "In"):
            return False
    return True


def test_sidecar_agents_are_scraped_and_daemonset_agents_once():
    """The ServiceMonitor reaches the metadata service and the DaemonSet's agents through
    their Services; agents in inference pods have no Service: a PodMonitor scrapes them."""
    rendered = render(SIDECAR, *MONITORING, "--set", "node.enabled=true")
    [pods] = [o for o in rendered if o["kind"] == "PodMonitor"]
    [endpoint] = pods["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["kvstore"]}
    for component in ("vllm", "sglang"):
        spec = deployment(rendered, component)["spec"]["template"]
        assert matches(pods["spec"]["selector"], spec["metadata"]["labels"])
        agent = spec["spec"]["initContainers"][0]
        assert endpoint["port"] in {port["name"] for port in agent["ports"]}
    daemonset = deployment(rendered, "node")["spec"]["template"]["metadata"]["labels"]
    assert not matches(pods["spec"]["selector"], daemonset)
    [services] = [o for o in rendered if o["kind"] == "ServiceMonitor"]
    wanted = services["spec"]["selector"]["matchLabels"].items()
    scraped = [
        o for o in rendered if o["kind"] == "Service" and wanted <= o["metadata"]["labels"].items()
    ]
    assert sorted(o["metadata"]["name"] for o in scraped) == [
        "kv-kvstore-metadata",
        "kv-kvstore-node",
    ]
    assert "PodMonitor" not in {o["kind"] for o in render(SIDECAR)}  # no prometheus-operator


def node_selectors(*values: str) -> list[dict | None]:
    rendered = render(None, "--set", "sidecar.examples.vllm.enabled=true", *values)
    return [pod_spec(deployment(rendered, c)).get("nodeSelector") for c in ("node", "vllm")]


def test_a_users_node_selector_is_the_one_the_agents_get():
    """Helm merges maps: a nodeSelector default in values.yaml stayed whatever a user set. The
    default is empty; node.gpuNodesOnly (true) adds the GPU label, and false removes it."""
    assert node_selectors() == [GPU_NODES, GPU_NODES]
    assert (
        node_selectors("--set", "node.nodeSelector.pool=a100")
        == [{"pool": "a100", **GPU_NODES}] * 2
    )
    only_mine = ("--set", "node.gpuNodesOnly=false", "--set", "node.nodeSelector.pool=cpu")
    assert node_selectors(*only_mine) == [{"pool": "cpu"}] * 2
    assert node_selectors("--set", "node.gpuNodesOnly=false") == [None, None]


def agent_args(rendered: list[dict]) -> list[str]:
    [agents] = [o for o in rendered if o["kind"] == "DaemonSet"]
    [container] = [c for c in pod_spec(agents)["containers"] if c["name"] == "kvstore-agent"]
    return container["args"]


def test_the_largest_block_reaches_the_agents_only_when_set():
    """node.maxBlockBytes lets blocks of several sizes share the arena (issue 32 part 2); its
    default 0 (one page) passes no flag, so the default render is unchanged."""
    assert "--max-block-bytes" not in agent_args(render())
    values = ("--set", "node.pageSizeBytes=262144", "--set", "node.maxBlockBytes=67108864")
    args = agent_args(render(None, *values))
    assert flag(args, "--max-block-bytes") == "67108864"
    assert flag(args, "--page-size-bytes") == "262144"


@pytest.mark.parametrize(
    ("largest", "why"),
    [
        ("1024", "at least node.pageSizeBytes"),
        ("300000000", "at most node.privateBufferBytes"),
        ("-1", "minimum"),
    ],
)
def test_a_largest_block_the_agent_would_refuse_is_refused(largest, why):
    """Below a page, beyond a private worker's buffer (256Mi) or negative, the agent refuses
    to start: the chart refuses to render, saying what to change."""
    result = helm_template(None, "--set", f"node.maxBlockBytes={largest}", check=False)
    assert result.returncode != 0
    assert "maxBlockBytes" in result.stderr and why in result.stderr, result.stderr
