"""Bearer tokens, tenant scoping and TLS on a real metadata service."""

import grpc
import pytest

from kvstore.errors import AuthError, PermissionDeniedError, UnavailableError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.servers import client_for, running_server

ADMIN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"
KEYS = [bytes([i]) * 16 for i in range(8)]


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# token tenant\n{ADMIN} *\n{ALICE} alice\n")
    return path


def test_missing_or_wrong_token_is_unauthenticated(tmp_path, token_file):
    with running_server(tmp_path, token_file=token_file) as server:
        with client_for(server) as anonymous, pytest.raises(AuthError, match="UNAUTHENTICATED"):
            anonymous.lookup("alice", KEYS)
        with (
            client_for(server, token="wrong-token-000000") as wrong,
            pytest.raises(AuthError, match="UNAUTHENTICATED: the bearer token is not valid"),
        ):
            wrong.stats()
        with client_for(server, token=ADMIN) as admin:
            assert admin.stats().backend == "lmdb"


def test_a_tenant_token_sees_only_its_tenant(tmp_path, token_file):
    with running_server(tmp_path, token_file=token_file) as server:
        with client_for(server, token=ADMIN) as admin:
            lease, _ = admin.register_node(NodeRecord("n"))
            admin.publish("n", lease, "alice", [BlockEntry(k, "host") for k in KEYS[:3]])
            admin.publish("n", lease, "bob", [BlockEntry(k, "host") for k in KEYS])
        with client_for(server, token=ALICE) as alice:
            assert alice.lookup("alice", KEYS).prefix_length == 3
            with pytest.raises(PermissionDeniedError, match="only act for tenant 'alice'"):
                alice.lookup("bob", KEYS)
            with pytest.raises(PermissionDeniedError):
                alice.register_node(NodeRecord("rogue"))
            for write in (alice.publish, alice.unpublish):  # as node "n", her own tenant
                with pytest.raises(PermissionDeniedError, match="node token"):
                    write("n", lease, "alice", [BlockEntry(KEYS[3], "host")])
            assert alice.lookup("alice", KEYS).prefix_length == 3
            with pytest.raises(PermissionDeniedError):
                next(alice.watch_events(from_seq=1))
            events = alice.watch_events(from_seq=1, tenant="alice")
            assert next(events).tenant == "alice"
            events.close()


def test_a_node_bound_token_acts_as_its_own_node_only(tmp_path):
    """Any node agent's `*` token could register a live node's id (taking its lease over, so
    its heartbeats failed) and drop its holdings; a token bound to a node acts as that node
    only, while an unbound one (an operator's) still acts as any."""
    node_a, node_b = "node-a-token-0123456789", "node-b-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} *\n{node_a} * node=a\n{node_b} * node=b\n")
    entries = [BlockEntry(k, "host") for k in KEYS]
    with running_server(tmp_path, token_file=tokens) as server:
        with client_for(server, token=node_a) as a, client_for(server, token=node_b) as b:
            lease_a, _ = a.register_node(NodeRecord("a"))
            a.publish("a", lease_a, "t", entries)
            lease_b, _ = b.register_node(NodeRecord("b"))
            attempts = {
                "register": lambda: b.register_node(NodeRecord("a")),
                "heartbeat": lambda: b.heartbeat("a", lease_a),
                "publish": lambda: b.publish("a", lease_a, "t", entries),
                "unpublish": lambda: b.unpublish("a", lease_a, "t", entries),
                "deregister": lambda: b.deregister_node("a", lease_a),
            }
            for action, attempt in attempts.items():
                refused = f"bound to node 'b': it cannot {action} as 'a'"
                with pytest.raises(PermissionDeniedError, match=refused):
                    attempt()
            a.heartbeat("a", lease_a)  # a's lease is still its own
            assert a.lookup("t", KEYS).prefix_length == len(KEYS)
        with client_for(server, token=ADMIN) as admin:
            admin.deregister_node("b", lease_b)


def test_a_token_line_with_a_bad_node_binding_is_refused(tmp_path):
    from kvstore.errors import ConfigError
    from kvstore.metadata.server.auth import load_tokens

    path = tmp_path / "tokens"
    for line in (f"{ADMIN} * node=", f"{ADMIN} * nodes=a", f"{ADMIN} * node=a extra"):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=r"TOKEN TENANT \[node=NODE_ID\]"):
            load_tokens(path)


def test_tls_with_a_token_accepts_trusting_clients_and_rejects_plaintext(
    tmp_path, tls_files, token_file
):
    with running_server(
        tmp_path, tls_cert=tls_files["cert"], tls_key=tls_files["key"], token_file=token_file
    ) as server:
        address = f"localhost:{server.port}"
        with MetadataClient(address, token=ADMIN, tls_ca=tls_files["ca"]) as client:
            lease, _ = client.register_node(NodeRecord("secure"))
            assert lease > 0
        with MetadataClient(address, token=ADMIN, timeout_s=1) as plaintext:
            with pytest.raises(UnavailableError):
                plaintext.stats()
        with MetadataClient(address, tls_ca=tls_files["ca"]) as no_token:
            with pytest.raises(AuthError):
                no_token.stats()


def test_health_check_answers_without_a_token(tmp_path, token_file):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with running_server(tmp_path, token_file=token_file) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert response.status == health_pb2.HealthCheckResponse.SERVING
