"""Bad input gets the right status code and a message saying what was wrong, and the service
keeps serving; hypothesis throws arbitrary and malformed messages at every handler."""

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.metadata.records import NodeRecord
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import client_for, running_server

KEY = bytes(16)
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("bad"), key_quota_per_tenant=50) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
        yield opened


@pytest.fixture(scope="module")
def lease(server):
    with client_for(server) as client:
        return client.register_node(NodeRecord("good-node"))[0]


def call(channel, method, request):
    rpc = channel.unary_unary(
        f"/kvstore.v1.Metadata/{method}",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=lambda b: b,
    )
    return rpc(request, timeout=5)


def status_of(channel, method, request):
    try:
        call(channel, method, request)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return CODE.OK, ""


def publish(lease, entries, node="good-node", tenant="t"):
    return pb.PublishRequest(node_id=node, lease_id=lease, tenant=tenant, entries=entries)


CASES = {
    "empty lookup": (
        "Lookup",
        lambda lease: pb.LookupRequest(tenant="t"),
        CODE.INVALID_ARGUMENT,
        "empty",
    ),
    "oversized lookup": (
        "Lookup",
        lambda lease: pb.LookupRequest(tenant="t", keys=[KEY] * 5000),
        CODE.INVALID_ARGUMENT,
        "limit is 4096",
    ),
    "short key": (
        "Lookup",
        lambda lease: pb.LookupRequest(tenant="t", keys=[b"abc"]),
        CODE.INVALID_ARGUMENT,
        "keys[0] is 3 bytes",
    ),
    "missing tenant": (
        "Lookup",
        lambda lease: pb.LookupRequest(keys=[KEY]),
        CODE.INVALID_ARGUMENT,
        "tenant",
    ),
    "bad tier": (
        "Publish",
        lambda lease: publish(lease, [pb.BlockEntry(key=KEY, tier=9)]),
        CODE.INVALID_ARGUMENT,
        "tier 9",
    ),
    "empty publish": ("Publish", lambda lease: publish(lease, []), CODE.INVALID_ARGUMENT, "empty"),
    "unknown node": (
        "Publish",
        lambda lease: publish(lease, [pb.BlockEntry(key=KEY, tier=2)], node="ghost"),
        CODE.NOT_FOUND,
        "unknown node 'ghost'",
    ),
    "stale lease": (
        "Heartbeat",
        lambda lease: pb.HeartbeatRequest(node_id="good-node", lease_id=lease + 7),
        CODE.FAILED_PRECONDITION,
        "not current",
    ),
    "quota": (
        "Publish",
        lambda lease: publish(
            lease, [pb.BlockEntry(key=bytes([i]) * 16, tier=2) for i in range(51)]
        ),
        CODE.RESOURCE_EXHAUSTED,
        "quota of 50",
    ),
    "bad node id": (
        "RegisterNode",
        lambda lease: pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="a b")),
        CODE.INVALID_ARGUMENT,
        "node.node_id",
    ),
    "missing node": (
        "RegisterNode",
        lambda lease: pb.RegisterNodeRequest(),
        CODE.INVALID_ARGUMENT,
        "node",
    ),
    "bad ttl": (
        "RegisterNode",
        lambda lease: pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="x"), lease_ttl_ms=1),
        CODE.INVALID_ARGUMENT,
        "lease_ttl_ms",
    ),
    "unknown tier capacity": (
        "RegisterNode",
        lambda lease: pb.RegisterNodeRequest(
            node=pb.NodeInfo(node_id="x", tier_capacity_bytes={"tape": 1})
        ),
        CODE.INVALID_ARGUMENT,
        "tape",
    ),
    "unknown route candidate": (
        "Route",
        lambda lease: pb.RouteRequest(tenant="t", keys=[KEY], candidate_node_ids=["zz"]),
        CODE.NOT_FOUND,
        "zz",
    ),
    "malformed bytes": (
        "Lookup",
        lambda lease: b"\xff\xff\xff",
        CODE.INVALID_ARGUMENT,
        "malformed LookupRequest",
    ),
    "oversized message": (
        "Lookup",
        lambda lease: pb.LookupRequest(tenant="t", keys=[KEY * 70_000] * 16),
        CODE.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    "oversized unpublish": (
        "Unpublish",
        lambda lease: pb.UnpublishRequest(
            node_id="good-node",
            lease_id=lease,
            tenant="t",
            entries=[pb.BlockEntry(key=KEY, tier=2)] * 4097,
        ),
        CODE.INVALID_ARGUMENT,
        "limit is 4096",
    ),
    "oversized publish": (
        "Publish",
        lambda lease: publish(lease, [pb.BlockEntry(key=KEY, tier=2)] * 4097),
        CODE.INVALID_ARGUMENT,
        "limit is 4096",
    ),
    "oversized route keys": (
        "Route",
        lambda lease: pb.RouteRequest(tenant="t", keys=[KEY] * 4097),
        CODE.INVALID_ARGUMENT,
        "limit is 4096",
    ),
    "oversized route candidates": (
        "Route",
        lambda lease: pb.RouteRequest(tenant="t", keys=[KEY], candidate_node_ids=["a"] * 4097),
        CODE.INVALID_ARGUMENT,
        "candidate_node_ids has 4097 entries; the limit is 4096",
    ),
    "long address": (
        "RegisterNode",
        lambda lease: pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="x", tcp_address="h" * 300)),
        CODE.INVALID_ARGUMENT,
        "node.tcp_address has 300 characters; the limit is 256",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_the_right_status_and_message(case, channel, lease, server):
    method, make, code, message = CASES[case]
    got_code, details = status_of(channel, method, make(lease))
    assert got_code == code, details
    assert message in details
    with client_for(server) as client:
        assert client.stats().backend == "lmdb", "the service keeps serving"


def test_a_valid_request_still_works_after_bad_ones(channel, lease):
    assert (
        status_of(channel, "Publish", publish(lease, [pb.BlockEntry(key=KEY, tier=2)]))[0]
        == CODE.OK
    )


_METHODS = {
    "RegisterNode": pb.RegisterNodeRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "DeregisterNode": pb.DeregisterNodeRequest,
    "Publish": pb.PublishRequest,
    "Unpublish": pb.UnpublishRequest,
    "Lookup": pb.LookupRequest,
    "Route": pb.RouteRequest,
    "Stats": pb.StatsRequest,
}
_ALLOWED = {
    CODE.OK,
    CODE.INVALID_ARGUMENT,
    CODE.NOT_FOUND,
    CODE.FAILED_PRECONDITION,
    CODE.RESOURCE_EXHAUSTED,
}
_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@_FUZZ
@given(method=st.sampled_from(sorted(_METHODS)), payload=st.binary(max_size=256))
def test_fuzzed_bytes_never_crash_a_handler(channel, method, payload):
    code, details = status_of(channel, method, payload)
    try:
        _METHODS[method].FromString(payload)
    except Exception:
        assert code == CODE.INVALID_ARGUMENT and "malformed" in details, details
        return
    assert code in _ALLOWED, (code, details)


names = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
keys = st.lists(st.binary(min_size=0, max_size=20), max_size=6)


@_FUZZ
@given(
    tenant=names,
    node=names,
    lookup_keys=keys,
    tier=st.integers(0, 5),
    lease_id=st.integers(0, 2**64 - 1),
)
def test_fuzzed_fields_get_a_client_error_status_not_internal(
    channel, lease, tenant, node, lookup_keys, tier, lease_id
):
    entries = [pb.BlockEntry(key=k, tier=tier) for k in lookup_keys]
    for method, request in (
        ("Lookup", pb.LookupRequest(tenant=tenant, keys=lookup_keys, caller_node_id=node)),
        (
            "Publish",
            pb.PublishRequest(node_id=node, lease_id=lease_id, tenant=tenant, entries=entries),
        ),
        ("Route", pb.RouteRequest(tenant=tenant, keys=lookup_keys, candidate_node_ids=[node])),
        ("Heartbeat", pb.HeartbeatRequest(node_id=node, lease_id=lease_id)),
    ):
        code, details = status_of(channel, method, request)
        assert code in _ALLOWED, (method, code, details)
