"""The Helm chart, checked by the real tools: helm lint, helm template for every values file of
`ci/`, kubernetes-validate for Kubernetes 1.30-1.35, checkov, the schema's refusals, and every
rendered kvstore container's args through `kvstore ... --check`."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import yaml

from kvstore.cli import main
from tests.deploy.mounts import build_mounts, container_args, container_env
from tests.deploy.tools import (
    BAD_VALUES,
    CHART,
    CI_VALUES,
    helm_template,
    kvstore_containers,
    objects,
    pod_spec,
    render,
    run_tool,
)

KUBERNETES_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0"]
MONITORING = ("--api-versions", "monitoring.coreos.com/v1")


def names(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


def test_there_are_values_files_for_each_shape():
    assert {names(p) for p in CI_VALUES} >= {
        "embedded-lmdb",
        "redis-replicas",
        "sidecar",
        "tls-auth",
    }


def test_helm_lint_is_clean():
    for values in [None, *CI_VALUES]:
        extra = ["--values", str(values)] if values else []
        result = run_tool("helm", "lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=names)
def test_every_render_validates_on_kubernetes_1_30_to_1_35(values):
    import kubernetes_validate

    rendered = render(values, *MONITORING)
    kinds = {obj["kind"] for obj in rendered}
    assert "ServiceMonitor" in kinds
    for version in KUBERNETES_VERSIONS:
        for obj in rendered:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: no schema in kubernetes-validate
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(
                    f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} "
                    f"at {list(exc.path)}"
                ) from None


def test_service_monitor_only_where_the_api_exists():
    assert not {"ServiceMonitor", "PodMonitor"} & {obj["kind"] for obj in render()}
    monitors = [obj for obj in render(None, *MONITORING) if obj["kind"] == "ServiceMonitor"]
    assert [m["spec"]["endpoints"][0]["port"] for m in monitors] == ["metrics"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("negative-capacity", "at '/node/hostCapacity': '-64Gi' does not match pattern"),
        (
            "unknown-backend",
            "at '/metadata/backend': value must be one of 'lmdb', 'redis', 'redis-cluster'",
        ),
        ("lmdb-replicas", "at '/metadata/replicas': value must be 1"),
        ("auth-without-secret", "at '/auth/existingSecret': minLength"),
    ],
)
def test_a_bad_values_file_fails_with_the_schemas_message(bad, message):
    result = helm_template(BAD_VALUES / f"{bad}.yaml", check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_an_unknown_value_is_refused():
    result = helm_template(None, "--set", "node.hostCapacityBytes=1Gi", check=False)
    assert result.returncode != 0
    assert "additional properties 'hostCapacityBytes' not allowed" in result.stderr


def containers_of(values):
    for obj in render(values):
        for container in kvstore_containers(obj):
            yield obj, container


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: names(v) if v else "default")
def test_every_kvstore_container_passes_check(values, monkeypatch, capsys):
    checked = []
    for obj, container in containers_of(values):
        with tempfile.TemporaryDirectory(prefix="kvchk", dir="/tmp") as root:
            mounts = build_mounts(pod_spec(obj), container, Path(root))
            env = container_env(container, mounts)
            args = container_args(container, env, mounts)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            rc = main([*args, "--check"])
            out = capsys.readouterr()
            assert rc == 0 and out.out.splitlines()[-1] == "ok", (args, out)
            for name in env:
                monkeypatch.delenv(name)
        checked.append(f"{obj['kind']}/{container['name']}")
    assert checked


def test_secrets_are_files_never_args_or_env():
    for values in CI_VALUES:
        for _, container in containers_of(values):
            for var in container.get("env", []):
                assert "secretKeyRef" not in var.get("valueFrom", {}), var
            joined = " ".join(container["args"])
            assert "redis://:" not in joined and "s3cret" not in joined


def test_redis_cluster_metadata_gets_its_seeds_and_wait():
    metadata = [
        c
        for obj, c in containers_of(CHART / "ci" / "redis-cluster-values.yaml")
        if c["name"] == "kvstore-metadata"
    ]
    args = " ".join(metadata[0]["args"])
    assert "--backend redis-cluster" in args
    assert "--redis-url redis://redis-0.redis:6379,redis-1.redis:6379" in args
    assert "--redis-wait-replicas 1 --redis-wait-timeout-ms 100" in args
    assert "--redis-shards" not in args  # one slot, the service's own default


def test_redis_cluster_metadata_shards_when_told():
    rendered = render(
        CHART / "ci" / "redis-cluster-values.yaml", "--set", "metadata.redis.shards=0"
    )
    metadata = [
        c for obj in rendered for c in kvstore_containers(obj) if c["name"] == "kvstore-metadata"
    ]
    assert "--redis-shards 0" in " ".join(metadata[0]["args"])


def test_agent_pods_follow_the_deployment_contract():
    rendered = render(CHART / "ci" / "tls-auth-values.yaml")
    daemonset = next(obj for obj in rendered if obj["kind"] == "DaemonSet")
    spec = pod_spec(daemonset)
    volumes = {v["name"]: v for v in spec["volumes"]}
    agent = next(c for c in spec["containers"] if c["name"] == "kvstore-agent")
    args = agent["args"]
    arena_mib = 64 * 1024
    shm = volumes["shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and int(shm["sizeLimit"].removesuffix("Mi")) >= arena_mib
    assert args[args.index("--host-capacity-bytes") + 1] == "64Gi"
    assert args[args.index("--node-id") + 1] == "$(NODE_NAME)"
    assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
    env = {
        v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for v in agent["env"]
    }
    assert env["NODE_NAME"] == "spec.nodeName" and env["POD_IP"] == "status.podIP"
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/kvstore"
    assert volumes["disk"]["hostPath"]["path"] == "/mnt/nvme/kvstore"
    security = agent["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert int(agent["resources"]["limits"]["memory"].removesuffix("Mi")) > arena_mib


def test_rdma_adds_ipc_lock_and_nothing_else():
    rendered = render(CHART / "ci" / "redis-replicas-values.yaml")
    spec = pod_spec(next(obj for obj in rendered if obj["kind"] == "DaemonSet"))
    agent = next(c for c in spec["containers"] if c["name"] == "kvstore-agent")
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert spec["hostNetwork"] is True
    assert agent["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1


def test_sidecar_examples_share_only_the_socket_directory():
    from kvstore.connectors.vllm.config import ConnectorSettings

    rendered = render(CHART / "ci" / "sidecar-values.yaml")
    assert "DaemonSet" not in {obj["kind"] for obj in rendered}
    engines = {
        o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o
        for o in rendered
        if o["kind"] == "Deployment"
    }
    for engine in ("vllm", "sglang"):
        spec = pod_spec(engines[engine])
        agent = spec["initContainers"][0]
        assert agent["restartPolicy"] == "Always"  # a native sidecar: up before the engine
        worker = spec["containers"][0]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["socket-dir"]
        shared = {m["name"] for m in agent["volumeMounts"]} & {
            m["name"] for m in worker["volumeMounts"]
        }
        assert shared == {"socket-dir"}
        socket_path = agent["args"][agent["args"].index("--socket-path") + 1]
        flag = {"vllm": "--kv-transfer-config", "sglang": "--hicache-storage-backend-extra-config"}
        config = json.loads(worker["args"][worker["args"].index(flag[engine]) + 1])
        if engine == "vllm":
            assert config["kv_connector"] == "KVStoreConnector"
            assert config["kv_connector_module_path"] == "kvstore.connectors.vllm.connector"
            settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
            assert settings.socket_path == socket_path
        else:
            assert config == {
                "backend_name": "kvstore",
                "module_path": "kvstore.connectors.sglang.backend",
                "class_name": "KVStoreHiCacheStorage",
                "interface_v1": 1,
                "socket_path": socket_path,
                "tenant": "default",
            }
            assert (
                worker["args"][worker["args"].index("--hicache-storage-backend") + 1] == "dynamic"
            )


def test_network_policies_admit_only_agents_to_transfer_ports():
    rendered = render(CHART / "ci" / "tls-auth-values.yaml")
    policies = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "NetworkPolicy"}
    node = policies["kv-kvstore-node"]["spec"]["ingress"]
    transfer = next(rule for rule in node if rule["ports"][0]["port"] == 50060)
    assert [
        peer["podSelector"]["matchLabels"]["kvstore.io/agent"] for peer in transfer["from"]
    ] == ["true"]
    metadata = policies["kv-kvstore-metadata"]["spec"]["ingress"][0]
    assert metadata["ports"] == [
        {"port": 50051, "protocol": "TCP"},
        {"port": 50052, "protocol": "TCP"},
    ]
    labels = [peer["podSelector"]["matchLabels"] for peer in metadata["from"]]
    assert {"kvstore.io/agent": "true"}.items() <= labels[0].items()


def test_metadata_serves_its_lookup_port_on_every_backend():
    """The port was opened on LMDB only: a Redis replica's id was its process's own, and a
    client behind the Service could Describe one replica and dial another. Replicas of one
    index share its id now, so every backend opens the port, and the NetworkPolicy lets it in."""
    for values, kind in (
        ("embedded-lmdb-values.yaml", "StatefulSet"),
        ("redis-replicas-values.yaml", "Deployment"),
        ("redis-cluster-values.yaml", "Deployment"),
    ):
        rendered = render(CHART / "ci" / values)
        metadata = {
            o["kind"]: o for o in rendered if o["metadata"]["name"] == "kv-kvstore-metadata"
        }
        container = pod_spec(metadata[kind])["containers"][0]
        args = container["args"]
        assert args[args.index("--lookup-listen") + 1] == "0.0.0.0:50052", values
        assert {"name": "lookup", "containerPort": 50052, "protocol": "TCP"} in container["ports"]
        service_ports = {port["name"]: port for port in metadata["Service"]["spec"]["ports"]}
        assert service_ports["lookup"]["port"] == 50052  # clients dial the gRPC host at this port
        assert service_ports["lookup"]["targetPort"] == "lookup"
        policy = metadata["NetworkPolicy"]["spec"]["ingress"][0]["ports"]
        assert {"port": 50052, "protocol": "TCP"} in policy, values


def test_lmdb_metadata_keeps_its_data_on_a_pvc_and_probes_grpc_health():
    rendered = render(CHART / "ci" / "embedded-lmdb-values.yaml")
    statefulset = next(obj for obj in rendered if obj["kind"] == "StatefulSet")
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    container = pod_spec(statefulset)["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 50051}
    assert container["livenessProbe"]["grpc"] == {"port": 50051}
    assert {obj["kind"] for obj in rendered} >= {"PodDisruptionBudget", "PriorityClass"}


def test_checkov_passes_or_each_skip_has_a_reason(tmp_path):
    config = CHART / ".checkov.yaml"
    for line in config.read_text().splitlines():
        if re.match(r"\s+- CKV_", line):
            assert re.search(r"#\s*\S+", line), f"skipped without a reason: {line}"
    reasons = {}  # (check id, Kind.namespace.name) -> the annotation's reason
    for values in CI_VALUES:
        manifest = helm_template(values, *MONITORING).stdout
        (tmp_path / values.name).write_text(manifest)
        for obj in objects(manifest):
            meta = obj["metadata"]
            for key, value in (meta.get("annotations") or {}).items():
                if key.startswith("checkov.io/skip"):
                    check_id, _, reason = value.partition("=")
                    resource = f"{obj['kind']}.{meta.get('namespace')}.{meta['name']}"
                    reasons[check_id, resource] = reason
    result = run_tool(
        "checkov",
        "--config-file",
        str(config),
        "-d",
        str(tmp_path),
        "--output",
        "json",
        check=False,
    )
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{check['check_id']} {check['resource']} ({check['file_path']})"
        for report in reports
        for check in report["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    assert sum(report["summary"]["passed"] for report in reports) > 100
    for report in reports:
        for skipped in report["results"]["skipped_checks"]:
            reason = reasons.get((skipped["check_id"], skipped["resource"]), "")
            assert len(reason) > 20, f"{skipped['check_id']} on {skipped['resource']}: no reason"


def test_no_template_leaves_a_value_unset():
    for values in [None, *CI_VALUES]:
        manifest = helm_template(values).stdout
        assert "<no value>" not in manifest and "%!" not in manifest
        for obj in objects(manifest):
            yaml.safe_dump(obj)


def test_worker_credentials_without_a_cluster_secret_are_refused():
    """The agent would refuse them at start (its transfer port would serve any tenant)."""
    result = helm_template(
        None, "--set", "node.workerCredentials.existingSecret=creds", check=False
    )
    assert result.returncode != 0
    assert "keeps tenants apart only with clusterSecret.existingSecret set" in result.stderr
    assert (
        helm_template(
            None,
            "--set",
            "node.workerCredentials.existingSecret=creds",
            "--set",
            "node.transfer=none",
            check=False,
        ).returncode
        == 0
    )


def test_without_secrets_the_services_run_open_only_where_they_say_so():
    """The agent refuses tcp without a cluster secret and the metadata service refuses 0.0.0.0
    without tokens unless told to run open: the chart tells them where only the NetworkPolicy
    guards their ports, and refuses the host network, where every process of the host could
    reach the transfer port."""
    flags = {c["name"]: c["args"] for _, c in containers_of(None)}
    assert "--insecure-transfer" in flags["kvstore-agent"]
    assert "--insecure-no-auth" in flags["kvstore-metadata"]
    for values in CI_VALUES:
        for _, container in containers_of(values):
            args = set(container["args"])
            assert not {"--cluster-secret-file", "--insecure-transfer"} <= args
            assert not {"--token-file", "--insecure-no-auth"} <= args
    host = helm_template(None, "--set", "node.hostNetwork=true", check=False)
    assert host.returncode != 0 and "set clusterSecret.existingSecret" in host.stderr


AUTH_ON = ("--set", "auth.enabled=true", "--set", "auth.existingSecret=kvstore-tokens")


def the(rendered: list[dict], kind: str, name: str | None = None) -> dict:
    [obj] = [o for o in rendered if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return obj


def secret_keys(rendered: list[dict]) -> set[str]:
    specs = [pod_spec(obj) for obj in rendered if pod_spec(obj)]
    volumes = [volume for spec in specs for volume in spec["volumes"]]
    return {item["key"] for v in volumes for item in v.get("secret", {}).get("items", [])}


def test_agents_present_projected_tokens_bound_to_their_node_by_default():
    """With auth on, every agent presents its own pod's service-account token (audience
    kvstore), never a shared `*` token; the metadata service reviews those of the agents' and
    the sidecars' accounts with its own token, which the ClusterRoleBinding lets it do."""
    rendered = render(None, *AUTH_ON, "--set", "sidecar.examples.vllm.enabled=true")
    spec = pod_spec(the(rendered, "DaemonSet"))
    assert spec["serviceAccountName"] == "kv-kvstore-agent"
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["agent-token"]["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "kvstore", "expirationSeconds": 3600, "path": "token"}}
    ]
    agent = next(c for c in spec["containers"] if c["name"] == "kvstore-agent")
    args = agent["args"]
    assert args[args.index("--metadata-token-file") + 1] == "/etc/kvstore/agent-token/token"
    assert args[args.index("--node-id") + 1] == "$(NODE_NAME)"  # the node its token names
    mount = {"name": "agent-token", "mountPath": "/etc/kvstore/agent-token", "readOnly": True}
    assert mount in agent["volumeMounts"]
    assert "agent.token" not in secret_keys(rendered)
    vllm = pod_spec(the(rendered, "Deployment", "kv-kvstore-vllm"))
    assert vllm["serviceAccountName"] == "kv-kvstore-sidecar"
    assert "agent-token" in {volume["name"] for volume in vllm["volumes"]}
    metadata = pod_spec(the(rendered, "StatefulSet"))
    assert metadata["serviceAccountName"] == "kv-kvstore-metadata"
    assert metadata["automountServiceAccountToken"] is False  # its one token volume is explicit
    args = metadata["containers"][0]["args"]
    assert args[args.index("--kube-agent-service-account") + 1] == "kvstore/kv-kvstore-agent"
    assert args[args.index("--kube-sidecar-service-account") + 1] == "kvstore/kv-kvstore-sidecar"
    mounts = {m["name"]: m["mountPath"] for m in metadata["containers"][0]["volumeMounts"]}
    assert mounts["kube-api-access"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    binding = the(rendered, "ClusterRoleBinding")
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kv-kvstore-metadata", "namespace": "kvstore"}
    ]
    accounts = [obj for obj in rendered if obj["kind"] == "ServiceAccount"]
    assert {account["metadata"]["name"] for account in accounts} == {
        "kv-kvstore-metadata",
        "kv-kvstore-agent",
        "kv-kvstore-sidecar",
    }
    assert all(account["automountServiceAccountToken"] is False for account in accounts)


def test_the_shared_agent_token_is_an_explicit_choice():
    rendered = render(None, *AUTH_ON, "--set", "auth.agentTokens=shared")
    spec = pod_spec(the(rendered, "DaemonSet"))
    args = next(c for c in spec["containers"] if c["name"] == "kvstore-agent")["args"]
    assert args[args.index("--metadata-token-file") + 1] == "/etc/kvstore/auth/agent.token"
    assert "agent-token" not in {volume["name"] for volume in spec["volumes"]}
    metadata = pod_spec(the(rendered, "StatefulSet"))["containers"][0]
    assert "--kube-agent-service-account" not in metadata["args"]
    for values in ((*AUTH_ON, "--set", "auth.agentTokens=shared"), ()):
        assert "ClusterRoleBinding" not in {obj["kind"] for obj in render(None, *values)}
    for bad, message in [
        ("auth.agentTokens=bound", "value must be one of 'projected', 'shared'"),
        ("auth.agentTokenExpirationSeconds=60", "minimum: got 60, want 600"),
    ]:
        result = helm_template(None, *AUTH_ON, "--set", bad, check=False)
        assert result.returncode != 0 and message in result.stderr, result.stderr
