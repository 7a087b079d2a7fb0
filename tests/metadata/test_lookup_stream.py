"""LookupStream on a real metadata service: the client's lookups ride open calls, a bad request
costs only its lookup, calls are bounded, idle ones end, a late answer is a deadline error, and
a service without the method (an older one) is asked with unary Lookups."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from kvstore.errors import (
    CapacityError,
    ConfigError,
    KVStoreError,
    PermissionDeniedError,
    UnavailableError,
)
from kvstore.metadata.client import lookup_calls
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.metadata.server.service import SERVICE_NAME, ServiceLimits
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import (
    ADMIN,
    ALICE,
    FAST_LIMITS,
    LOOKUP_KEYS,
    calls,
    client_for,
    publish,
    running_server,
    wait_until,
)

KEYS = LOOKUP_KEYS


def test_lookups_ride_one_open_call_and_answer_as_unary_lookups_do(tmp_path):
    with running_server(tmp_path) as server, client_for(server, lookup_port=False) as client:
        publish(client)
        with client_for(server, lookup_port=False, lookup_streams=False) as unary:
            expected = unary.lookup("t", KEYS, caller_node_id="me")
        assert calls(server, "LookupStream") == 0
        for _ in range(20):
            assert client.lookup("t", KEYS, caller_node_id="me") == expected
        assert expected.prefix_length == 5
        assert expected.addresses == {"holder": ("10.0.0.1:1", "")}
        assert calls(server, "LookupStream") == 1  # one call carried the 20 lookups
        assert calls(server, "Lookup") == 21  # each lookup counted as one, either way


def test_a_bad_request_fails_its_lookup_only_and_the_call_stays_open(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=token_file) as server:
        with client_for(server, lookup_port=False, token=ADMIN) as admin:
            publish(admin, "alice")
        with client_for(server, lookup_port=False, token=ALICE) as alice:
            assert alice.lookup("alice", KEYS).prefix_length == 5
            with pytest.raises(ConfigError, match=r"INVALID_ARGUMENT: .*16 bytes"):
                alice.lookup("alice", [b"short"])
            with pytest.raises(PermissionDeniedError, match="only act for tenant 'alice'"):
                alice.lookup("bob", KEYS)
            assert alice.lookup("alice", KEYS).prefix_length == 5
        assert calls(server, "LookupStream") == 1
        assert calls(server, "Lookup", "INVALID_ARGUMENT") == 1
        assert calls(server, "Lookup", "PERMISSION_DENIED") == 1


def test_a_malformed_message_is_answered_with_invalid_argument_on_the_same_call(tmp_path):
    with running_server(tmp_path) as server, client_for(server, lookup_port=False) as client:
        publish(client)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            method = channel.stream_stream(f"/{SERVICE_NAME}/LookupStream")
            good = pb.LookupRequest(tenant="t", keys=KEYS).SerializeToString()
            answers = list(method(iter([b"\xff\xff\xff", good]), timeout=5))
        bad, fine = (pb.LookupStreamResponse.FromString(a) for a in answers)
        assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == bad.status_code
        assert "malformed LookupRequest" in bad.status_message
        assert fine.status_code == 0 and fine.response.prefix_length == 5


def test_concurrent_lookups_hold_a_bounded_number_of_calls(tmp_path):
    with running_server(tmp_path) as server, client_for(server, lookup_port=False) as client:
        publish(client)
        errors, counts = [], []

        def look() -> None:
            try:
                counts.extend(client.lookup("t", KEYS).prefix_length for _ in range(100))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=look) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors and counts == [5] * 800
        assert 1 <= calls(server, "LookupStream") <= lookup_calls.MAX_OPEN
        assert server.servicer.lookup_streams.slots.open_count("*") <= lookup_calls.MAX_OPEN
    assert calls(server, "Lookup") == 800


def test_past_the_slot_cap_lookups_go_unary(tmp_path):
    with running_server(tmp_path, max_lookup_streams_all_tenants=1) as server:
        with (
            client_for(server, lookup_port=False) as first,
            client_for(server, lookup_port=False) as second,
        ):
            publish(first)
            assert first.lookup("t", KEYS).prefix_length == 5
            for _ in range(3):
                assert second.lookup("t", KEYS).prefix_length == 5
        assert calls(server, "LookupStream") == 1
        assert calls(server, "LookupStream", "RESOURCE_EXHAUSTED") == 1  # then unary, no retry
        assert calls(server, "Lookup") == 4


def test_an_idle_call_is_ended_by_the_service_and_the_next_lookup_opens_another(tmp_path):
    limits = ServiceLimits(min_lease_ttl_ms=200, watch_poll_s=0.1, lookup_stream_idle_s=0.4)
    config = MetadataConfig(listen="127.0.0.1:0", data_dir=tmp_path / "meta", limits=limits)
    server = MetadataServer(config)
    server.start()
    try:
        with client_for(server, lookup_port=False) as client:
            publish(client)
            assert client.lookup("t", KEYS).prefix_length == 5
            slots = server.servicer.lookup_streams.slots
            assert slots.open_count("*") == 1
            assert wait_until(lambda: slots.open_count("*") == 0, timeout_s=3)  # ended, freed
            assert client.lookup("t", KEYS).prefix_length == 5
            assert calls(server, "LookupStream") == 2
    finally:
        server.stop(grace_s=0.5)


class SlowIndex(MemoryIndex):
    """Reads block (as Redis's do) and take `delay_s` while `slow` is set."""

    nonblocking_reads = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow = threading.Event()
        self.delay_s = 1.0

    def lookup(self, tenant, keys, anchor=None):
        if self.slow.is_set():
            time.sleep(self.delay_s)
        return super().lookup(tenant, keys, anchor)


def test_a_late_answer_is_a_deadline_error_and_the_next_lookup_is_answered(tmp_path):
    server, index = slow_server(tmp_path)
    try:
        with client_for(server, lookup_port=False) as client:
            publish(client)
            assert client.lookup("t", KEYS).prefix_length == 5
            index.slow.set()
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
                client.lookup("t", KEYS, timeout_s=0.2)
            assert time.monotonic() - started < 0.2 + 0.5
            index.slow.clear()
            assert client.lookup("t", KEYS).prefix_length == 5  # on a new call
    finally:
        server.stop(grace_s=0.5)


def test_a_service_without_lookup_stream_is_asked_with_unary_lookups():
    answered = []

    def lookup(payload: bytes, context) -> bytes:
        answered.append(pb.LookupRequest.FromString(payload).tenant)
        return pb.LookupResponse(prefix_length=0).SerializeToString()

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"Lookup": grpc.unary_unary_rpc_method_handler(lookup)}
    )
    old = grpc.server(futures.ThreadPoolExecutor(2), handlers=(handler,))
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    try:
        from kvstore.metadata.client import MetadataClient

        with MetadataClient(f"127.0.0.1:{port}") as client:
            for _ in range(3):
                assert client.lookup("t", KEYS).prefix_length == 0
            assert client._lookup_calls._unary_until == float("inf")  # not asked again
        assert answered == ["t"] * 3
    finally:
        old.stop(0)


def slow_server(tmp_path, **settings) -> tuple[MetadataServer, SlowIndex]:
    index = SlowIndex(None)
    limits = settings.pop("limits", FAST_LIMITS)
    config = MetadataConfig(listen="127.0.0.1:0", backend="memory", limits=limits, **settings)
    server = MetadataServer(config, index=index)
    server.start()
    return server, index


def test_a_refused_second_call_leaves_the_open_one_in_use(tmp_path):
    server, index = slow_server(tmp_path, max_lookup_streams_all_tenants=1)
    try:
        with client_for(server, lookup_port=False) as client:
            publish(client)
            index.delay_s = 0.5
            index.slow.set()
            both = [threading.Thread(target=client.lookup, args=("t", KEYS)) for _ in range(2)]
            for thread in both:
                thread.start()
            for thread in both:
                thread.join()
            index.slow.clear()
            assert calls(server, "LookupStream", "RESOURCE_EXHAUSTED") == 1
            (open_call,) = client._lookup_calls._idle
            answered = open_call.answered
            for _ in range(20):
                assert client.lookup("t", KEYS).prefix_length == 5
            assert open_call.answered == answered + 20  # not unary for the backoff's 10 s
    finally:
        server.stop(grace_s=0.5)


def test_an_oversized_lookup_fails_alone_and_streams_stay_on(tmp_path):
    with (
        running_server(tmp_path) as server,
        client_for(server, lookup_port=False, max_message_bytes=4096) as client,
    ):
        publish(client)
        assert client.lookup("t", KEYS).prefix_length == 5
        with pytest.raises(CapacityError, match="RESOURCE_EXHAUSTED"):
            client.lookup("t", [bytes([i % 256, i // 256]) * 8 for i in range(400)])
        assert client._lookup_calls._unary_until == 0.0
        assert client.lookup("t", KEYS).prefix_length == 5
        assert calls(server, "LookupStream") == 2  # the failed call's, then a new one


def test_a_lookup_answered_slower_than_the_idle_time_is_not_ended_as_idle(tmp_path):
    limits = ServiceLimits(min_lease_ttl_ms=200, watch_poll_s=0.1, lookup_stream_idle_s=0.3)
    server, index = slow_server(tmp_path, limits=limits)
    try:
        with client_for(server, lookup_port=False) as client:
            publish(client)
            index.delay_s = 0.8
            index.slow.set()
            assert client.lookup("t", KEYS, timeout_s=3).prefix_length == 5
            assert calls(server, "LookupStream") == 1
    finally:
        server.stop(grace_s=0.5)


def test_a_lookup_with_no_time_left_is_not_sent(tmp_path):
    with running_server(tmp_path) as server, client_for(server, lookup_port=False) as client:
        publish(client)
        with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
            client.lookup("t", KEYS, timeout_s=0)
        assert calls(server, "Lookup") == 0


def test_closing_the_client_under_lookups_raises_kvstore_errors_only(tmp_path):
    with running_server(tmp_path) as server:
        client = client_for(server, lookup_port=False)
        publish(client)
        failures = []

        def look() -> None:
            try:
                while True:
                    client.lookup("t", KEYS)
            except Exception as exc:
                failures.append(exc)

        threads = [threading.Thread(target=look) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        client.close()
        for thread in threads:
            thread.join(timeout=5)
        assert len(failures) == 3
        assert all(isinstance(f, KVStoreError) for f in failures), failures


def test_unflattening_keeps_each_keys_holders_when_counts_are_not_all_one():
    from kvstore.metadata.client import lookup_result

    response = pb.LookupResponse(
        prefix_length=2,
        nodes=[pb.NodeAddress(node_id="a"), pb.NodeAddress(node_id="b")],
        holder_counts=[0, 2],
        holder_nodes=[0, 1],
        holder_tiers=[pb.TIER_HOST, pb.TIER_DISK],
    )
    holders = lookup_result(response).holders
    assert [[(h.node_id, h.tier) for h in key] for key in holders] == [
        [],
        [("a", "host"), ("b", "disk")],
    ]
