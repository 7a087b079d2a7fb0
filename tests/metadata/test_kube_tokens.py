"""Agents' Kubernetes tokens on a real metadata service, reviewed over HTTPS by a loopback
stand-in for kube-apiserver's TokenReview API (kube_apiserver.py: no real API server can run
here). A token acts as its own node only; refusals carry their status; an API server that cannot
answer refuses the call (UNAVAILABLE), never lets it through; a verdict is cached, so lookups
make no review; the agent presents its token file's current token as the kubelet rotates it."""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager

import pytest

from kvstore.errors import AuthError, ConfigError, PermissionDeniedError, UnavailableError
from kvstore.metadata.client.token_file import TokenFile
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.metadata.server import kube_tokens
from kvstore.metadata.server.kube_api import KubeApi, in_cluster_url
from kvstore.metadata.server.server import MetadataConfig
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.kube_apiserver import OWN_TOKEN, REVIEW_PATH, running_apiserver
from tests.metadata.servers import (
    ADMIN,
    LOOKUP_KEYS,
    calls,
    client_for,
    running_server,
    wait_until,
)
from tests.metadata.test_lookup_port import answer, connect, ended, hello, send
from tests.node.agents import running_agent

AGENTS = "kvstore/kv-agent"
SIDECARS = "kvstore/kv-sidecar"
UNAUTHENTICATED, OK = 16, 0


@contextmanager
def agent_service(tmp_path, **settings):
    """A stand-in API server, and a metadata service whose agents are `kvstore/kv-agent`
    (and whose operator token is ADMIN)."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{ADMIN} *\n")
    with running_apiserver(tmp_path) as apiserver:
        settings = {
            "kube_agent_service_account": AGENTS,
            "kube_api_url": apiserver.url,
            "kube_credentials_dir": apiserver.credentials_dir,
            "token_file": tokens,
            **settings,
        }
        with running_server(tmp_path, **settings) as server:
            yield apiserver, server


def live_nodes(client) -> set[str]:
    return {node.node.node_id for node in client.stats().nodes}


def entries():
    return [BlockEntry(key, "host", 1, 1) for key in LOOKUP_KEYS]


def test_an_agent_token_publishes_as_its_node_after_one_review(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        token = apiserver.api.issue(node="node-a")
        with client_for(server, token=token) as agent:
            lease, _ = agent.register_node(NodeRecord("node-a", tcp_address="10.0.0.1:1"))
            assert agent.publish("node-a", lease, "t", entries()) == len(LOOKUP_KEYS)
            agent.heartbeat("node-a", lease)
            assert agent.lookup("t", LOOKUP_KEYS).prefix_length == len(LOOKUP_KEYS)
            assert agent.deregister_node("node-a", lease) == len(LOOKUP_KEYS)
        [review] = apiserver.api.reviews()
        assert review["authorization"] == f"Bearer {OWN_TOKEN}"  # the service's own token
        assert review["body"] == {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": ["kvstore"]},
        }


def test_the_same_token_cannot_act_as_another_node(tmp_path):
    """The shared `*` token let one compromised node publish, unpublish and deregister as any
    other; a reviewed token acts as the node its pod runs on, and as no other."""
    with agent_service(tmp_path) as (apiserver, server):
        with client_for(server, token=ADMIN) as admin:
            lease_b, _ = admin.register_node(NodeRecord("node-b", tcp_address="10.0.0.2:1"))
            admin.publish("node-b", lease_b, "t", entries())
        with client_for(server, token=apiserver.api.issue(node="node-a")) as agent:
            attempts = {
                "register": lambda: agent.register_node(NodeRecord("node-b")),
                "heartbeat": lambda: agent.heartbeat("node-b", lease_b),
                "publish": lambda: agent.publish("node-b", lease_b, "t", entries()),
                "unpublish": lambda: agent.unpublish("node-b", lease_b, "t", entries()),
                "deregister": lambda: agent.deregister_node("node-b", lease_b),
            }
            for action, attempt in attempts.items():
                with pytest.raises(
                    PermissionDeniedError,
                    match="PERMISSION_DENIED: this token "
                    f"is bound to node 'node-a': it cannot {action}",
                ):
                    attempt()
        with client_for(server, token=ADMIN) as admin:
            assert admin.lookup("t", LOOKUP_KEYS).prefix_length == len(LOOKUP_KEYS)
            assert admin.heartbeat("node-b", lease_b)


@pytest.mark.parametrize(
    ("issued", "refusal", "message"),
    [
        (
            {"forged": True},
            AuthError,
            "UNAUTHENTICATED: the agent token is not valid: [invalid bearer token",
        ),
        ({"audiences": ("vault",)}, AuthError, "not a token for audience 'kvstore'"),
        ({"audience_agnostic": True}, AuthError, "not valid for audience 'kvstore'"),
        (
            {"account": "kvstore/default"},
            PermissionDeniedError,
            "'system:serviceaccount:kvstore:default' is not a kvstore agent's service account",
        ),
        (
            {"account": "other/kv-agent"},
            PermissionDeniedError,
            "'system:serviceaccount:other:kv-agent' is not a kvstore agent's",
        ),
        ({"node": None}, AuthError, "names no authentication.kubernetes.io/node-name"),
        ({"ttl_s": -10}, AuthError, "the agent token has expired"),
    ],
    ids=[
        "unauthenticated",
        "audience",
        "no-audiences",
        "account",
        "namespace",
        "unbound",
        "expired",
    ],
)
def test_a_token_that_is_not_an_agents_is_refused(tmp_path, issued, refusal, message):
    issued = dict(issued)
    with agent_service(tmp_path) as (apiserver, server):
        apiserver.api.audience_agnostic = issued.pop("audience_agnostic", False)
        forged = issued.pop("forged", False)
        token = apiserver.api.issue(**issued)
        if forged:
            del apiserver.api.issued[token]  # signed by no key the API server knows
        with client_for(server, token=token) as caller:
            for _ in range(2):  # the second refusal from the cache, as the first
                with pytest.raises(refusal, match=re.escape(message)) as refused:
                    caller.register_node(NodeRecord("node-a"))
                if refusal is AuthError:
                    assert not isinstance(refused.value, PermissionDeniedError)
        prefiltered = "audiences" in issued or "ttl_s" in issued  # not a kvstore token at all
        assert len(apiserver.api.reviews()) == (0 if prefiltered else 1)


def test_an_api_server_that_cannot_answer_refuses_the_call_never_admits_it(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        verified = apiserver.api.issue(node="node-a")
        with client_for(server, token=verified) as agent:
            agent.register_node(NodeRecord("node-a"))
        apiserver.api.refuse_with = 403  # the service's account lacks system:auth-delegator
        with client_for(server, token=apiserver.api.issue(node="node-c")) as agent:
            with pytest.raises(
                UnavailableError,
                match=r"UNAVAILABLE: .*refused this service's TokenReview \(HTTP 403\).*"
                r"system:auth-delegator",
            ):
                agent.register_node(NodeRecord("node-c"))
            apiserver.api.refuse_with = 500
            with pytest.raises(UnavailableError, match="HTTP 500"):
                agent.register_node(NodeRecord("node-c"))
            apiserver.api.refuse_with = 0  # a failure is not remembered: asked again, admitted
            agent.register_node(NodeRecord("node-c"))
        apiserver.stop()
        with client_for(server, token=apiserver.api.issue(node="node-d")) as agent:
            with pytest.raises(UnavailableError, match="did not answer a TokenReview"):
                agent.register_node(NodeRecord("node-d"))
        with client_for(server, token=verified) as agent:  # verified lately: still trusted
            agent.register_node(NodeRecord("node-a"))


def test_lookups_make_no_review_after_the_first(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        token = apiserver.api.issue(node="node-a")
        with client_for(server, token=token) as agent:
            lease, _ = agent.register_node(NodeRecord("node-a", tcp_address="10.0.0.1:1"))
            agent.publish("node-a", lease, "t", entries())
            for _ in range(50):  # on the lookup port
                assert agent.lookup("t", LOOKUP_KEYS).prefix_length == len(LOOKUP_KEYS)
        with client_for(server, token=token, lookup_port=False, lookup_streams=False) as unary:
            for _ in range(50):
                assert unary.lookup("t", LOOKUP_KEYS).prefix_length == len(LOOKUP_KEYS)
        assert len(apiserver.api.reviews()) == 1


def test_callers_of_one_new_token_share_its_review(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        apiserver.api.delay_s = 0.3
        token = apiserver.api.issue(node="node-a")
        with client_for(server, token=token, lookup_port=False, lookup_streams=False) as agent:
            threads = [
                threading.Thread(target=agent.lookup, args=("t", LOOKUP_KEYS)) for _ in range(8)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert len(apiserver.api.reviews()) == 1


def test_reviews_under_way_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(kube_tokens, "MAX_REVIEWS", 1)
    with agent_service(tmp_path) as (apiserver, server):
        apiserver.api.delay_s = 1.0
        first = client_for(server, token=apiserver.api.issue(node="node-a"))
        second = client_for(server, token=apiserver.api.issue(node="node-b"))
        with first, second:
            slow = threading.Thread(target=first.register_node, args=(NodeRecord("node-a"),))
            slow.start()
            assert wait_until(lambda: len(apiserver.api.reviews()) == 1)  # under review
            with pytest.raises(UnavailableError, match="1 agent tokens are under review"):
                second.register_node(NodeRecord("node-b"))
            slow.join()


def test_a_hello_on_the_lookup_port_waits_for_its_tokens_review(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        with client_for(server, token=ADMIN) as admin:
            lease, _ = admin.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"))
            admin.publish("holder", lease, "t", entries())
        apiserver.api.delay_s = 0.2
        with connect(server) as sock:
            assert hello(sock, server, apiserver.api.issue(node="node-a")).status_code == OK
            request = pb.LookupRequest(tenant="t", keys=LOOKUP_KEYS)
            send(sock, request.SerializeToString())
            send(sock, request.SerializeToString())  # a second frame, queued behind the first
            for _ in range(2):
                assert answer(sock).response.prefix_length == len(LOOKUP_KEYS)
        forged = apiserver.api.issue(node="node-a")
        del apiserver.api.issued[forged]
        with connect(server) as sock:
            refused = hello(sock, server, forged)
            assert refused.status_code == UNAUTHENTICATED
            assert "the agent token is not valid" in refused.status_message
            assert ended(sock)
        assert len(apiserver.api.reviews()) == 2


def test_a_token_is_trusted_no_longer_than_it_lives(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        token = apiserver.api.issue(node="node-a", ttl_s=2)
        with client_for(server, token=token) as agent:
            agent.register_node(NodeRecord("node-a"))
            time.sleep(2.2)
            with pytest.raises(AuthError, match="the agent token has expired"):
                agent.register_node(NodeRecord("node-a"))


def test_a_sidecar_token_acts_as_its_pod_and_not_its_node(tmp_path):
    with agent_service(tmp_path, kube_sidecar_service_account=SIDECARS) as (apiserver, server):
        sidecar = apiserver.api.issue(node="node-a", pod="vllm-0", account=SIDECARS)
        with client_for(server, token=sidecar) as agent:
            agent.register_node(NodeRecord("vllm-0"))
            with pytest.raises(PermissionDeniedError, match="bound to node 'vllm-0'"):
                agent.register_node(NodeRecord("node-a"))
        daemonset = apiserver.api.issue(node="node-a", pod="kv-node-x1")
        with client_for(server, token=daemonset) as agent:
            agent.register_node(NodeRecord("node-a"))
            with pytest.raises(PermissionDeniedError, match="bound to node 'node-a'"):
                agent.register_node(NodeRecord("kv-node-x1"))


def kubelet_writes(directory, token: str, generation: int) -> None:
    """The kubelet's atomic writer: a new timestamped directory, then `..data` swapped to it
    (`token` is a link through `..data`)."""
    data = directory / f"..2025_01_01_00_00_0{generation}"
    data.mkdir()
    (data / "token").write_text(token)
    (directory / "..data_tmp").symlink_to(data.name)
    (directory / "..data_tmp").rename(directory / "..data")
    if not (directory / "token").is_symlink():
        (directory / "token").symlink_to("..data/token")


def test_the_agent_presents_its_token_as_the_kubelet_rotates_it(tmp_path):
    with agent_service(tmp_path) as (apiserver, server):
        mounted = tmp_path / "kube-token"
        mounted.mkdir()
        first, second = apiserver.api.issue(node="node-a"), apiserver.api.issue(node="node-a")
        kubelet_writes(mounted, first, 1)
        token_file = TokenFile(mounted / "token", recheck_s=0.0)
        with client_for(server, token=token_file) as agent:
            lease, _ = agent.register_node(NodeRecord("node-a", tcp_address="10.0.0.1:1"))
            kubelet_writes(mounted, second, 2)
            del apiserver.api.issued[first]  # expired, as far as the API server is concerned
            agent.heartbeat("node-a", lease)
            agent.publish("node-a", lease, "t", entries())
        reviewed = [review["body"]["spec"]["token"] for review in apiserver.api.reviews()]
        assert reviewed == [first, second]


def test_an_agent_started_with_its_pods_token_registers_and_follows_as_its_node(tmp_path):
    """The whole agent: its link registers and heartbeats, its view opens Snapshot and
    WatchEventBatches streams, all with the pod's token, reviewed once."""
    with agent_service(tmp_path) as (apiserver, server):
        mounted = tmp_path / "agent-token"
        mounted.mkdir()
        kubelet_writes(mounted, apiserver.api.issue(node="node-a"), 1)
        address = f"127.0.0.1:{server.port}"
        with running_agent(
            tmp_path,
            "node-a",
            transfer="tcp",
            transfer_host="127.0.0.1",
            metadata_address=address,
            metadata_token_file=mounted / "token",
        ):
            with client_for(server, token=ADMIN) as admin:
                assert wait_until(lambda: live_nodes(admin) == {"node-a"})
                assert wait_until(lambda: calls(server, "WatchEventBatches") >= 1)
        assert len(apiserver.api.reviews()) == 1


def test_agent_service_accounts_are_checked_at_the_edge(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError, match="kube_agent_service_account 'kv-agent': expected NAMESPACE/NAME"
    ):
        MetadataConfig(kube_agent_service_account="kv-agent")
    with pytest.raises(ConfigError, match="must differ: a sidecar could otherwise act as"):
        MetadataConfig(kube_agent_service_account=AGENTS, kube_sidecar_service_account=AGENTS)
    with pytest.raises(ConfigError, match="expected https://HOST"):
        KubeApi("http://10.96.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match=r"KUBERNETES_SERVICE_HOST .* unset"):
        MetadataConfig(kube_agent_service_account=AGENTS).kube_api()
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_url(env) == "https://[fd00::1]:443"


def test_check_names_missing_service_credentials(tmp_path, capsys):
    from kvstore.checks import check_metadata

    config = MetadataConfig(
        kube_agent_service_account=AGENTS,
        kube_api_url="https://10.96.0.1",
        kube_credentials_dir=tmp_path / "absent",
        data_dir=tmp_path / "meta",
    )
    with pytest.raises(ConfigError, match="cannot read service account token from"):
        check_metadata(config)
    with running_apiserver(tmp_path) as apiserver:
        good = MetadataConfig(
            kube_agent_service_account=AGENTS,
            kube_api_url=apiserver.url,
            kube_credentials_dir=apiserver.credentials_dir,
            data_dir=tmp_path / "meta",
        )
        assert check_metadata(good) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok"
    assert not [r for r in apiserver.api.requests if r["path"] == REVIEW_PATH]
