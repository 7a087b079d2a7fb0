"""WatchEventBatches: many events a message, each event encoded once however many streams send
it; the client's event streams read it (and WatchEvents from a service without it)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, IndexEvent, NodeRecord
from kvstore.metadata.server.event_frames import EventFrames, event_to_proto, gap_event
from kvstore.metadata.server.service import SERVICE_NAME
from kvstore.v1 import metadata_pb2 as pb
from kvstore.v1 import metadata_pb2_grpc as pb_grpc
from tests.metadata.servers import client_for, running_server, wait_until

KEYS = [n.to_bytes(16, "big") for n in range(1000)]
WATCHERS = 3


def collect(client, into: list, tenant: str = "") -> threading.Thread:
    def run() -> None:
        for event in client.watch_events(1, tenant):
            into.append(event)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def publish_all(client, tenant: str = "t", keys=KEYS) -> None:
    lease, _ = client.register_node(NodeRecord("holder"))
    for start in range(0, len(keys), 100):
        entries = [BlockEntry(k, "host") for k in keys[start : start + 100]]
        client.publish("holder", lease, tenant, entries)


def test_three_streams_get_every_event_each_encoded_once(tmp_path):
    with running_server(tmp_path) as server:
        clients = [client_for(server) for _ in range(WATCHERS)]
        seen: list[list] = [[] for _ in range(WATCHERS)]
        for client, into in zip(clients, seen, strict=True):
            collect(client, into)
        with client_for(server) as publisher:
            publish_all(publisher)
        assert wait_until(lambda: all(len(s) == len(KEYS) for s in seen), timeout_s=10)
        for events in seen:
            assert [e.key for e in events] == KEYS
            assert [e.seq for e in events] == list(range(1, len(KEYS) + 1))
        assert server.streams.frames.encoded == len(KEYS)  # not once per stream
        for client in clients:
            client.close()


def test_a_batch_carries_many_events_and_only_its_tenants(tmp_path):
    with running_server(tmp_path) as server:
        with client_for(server) as publisher:
            publish_all(publisher, "other", KEYS[:300])
            publish_all(publisher, "t", KEYS[300:])
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.MetadataStub(channel)
            call = stub.WatchEventBatches(pb.WatchEventsRequest(from_seq=1, tenant="t"))
            batches, events = [], []
            for batch in call:
                batches.append(batch)
                events += batch.events
                if len(events) == 700:
                    call.cancel()
                    break
        assert {e.tenant for e in events} == {"t"} and [e.key for e in events] == KEYS[300:]
        assert len(batches) < len(events) / 100


def test_a_batch_is_the_protobuf_encoding_of_its_events_with_a_gap_first():
    frames = EventFrames(capacity=4)
    events = [IndexEvent(seq, "stored", "t", KEYS[seq], "n", "host") for seq in range(5, 11)]
    encoded = frames.batch(7, events, "", gap_seq=4)
    expected = pb.EventBatch(events=[gap_event(4)] + [event_to_proto(e) for e in events])
    assert encoded == expected.SerializeToString()
    assert (
        frames.batch(7, events[-4:], "", None)
        == pb.EventBatch(events=[event_to_proto(e) for e in events[-4:]]).SerializeToString()
    )
    assert frames.encoded == 6  # the last four were kept (capacity 4), not encoded again
    assert frames.batch(7, [], "", None) == b""


def test_the_client_reads_watch_events_from_a_service_without_batches():
    """A service that predates WatchEventBatches answers UNIMPLEMENTED: the client's stream
    reads WatchEvents instead, from the same seq."""

    def watch_events(request: pb.WatchEventsRequest, context):
        for seq in range(request.from_seq, request.from_seq + 3):
            yield pb.Event(seq=seq, kind=pb.Event.KIND_STORED, key=KEYS[seq], tenant="t")

    method = grpc.unary_stream_rpc_method_handler(
        watch_events,
        request_deserializer=pb.WatchEventsRequest.FromString,
        response_serializer=pb.Event.SerializeToString,
    )
    older = grpc.server(ThreadPoolExecutor(2))
    older.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"WatchEvents": method}),)
    )
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        with MetadataClient(f"127.0.0.1:{port}", lookup_port=False) as client:
            events = list(client.watch_events(5, "t"))
        assert [e.seq for e in events] == [5, 6, 7] and events[0].key == KEYS[5]
    finally:
        older.stop(0)
