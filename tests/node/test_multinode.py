"""Three hosts on loopback: a metadata service and three node agents, all separate processes.
A prefix saved through node 1 is loaded through node 3, over tcp and over ucx; a holder that
dies or serves corrupt bytes costs a miss, never wrong data."""

import signal
import time

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import MetadataClient
from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import start_node_process

KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 6), 256)
PAYLOAD = 300_000


@pytest.fixture
def cluster(tmp_path, request):
    """Metadata service + node-1..3 using the transport of the test's parameter."""
    transport, _, secrets = request.param.partition("+")
    processes = []
    metadata, address = start_cli("metadata", "--backend", "memory", "--listen", "127.0.0.1:0")
    processes.append(metadata)
    sockets = {}
    try:
        for index in (1, 2, 3):
            node, path = start_node_process(
                tmp_path,
                f"node-{index}",
                "--metadata-address",
                address,
                "--transfer",
                transport,
                "--disk-dir",
                str(tmp_path / f"disk-{index}"),
                "--disk-capacity-bytes",
                "64MiB",
                *_secret_flags(tmp_path, secrets, index),
            )
            processes.append(node)
            sockets[index] = path
        yield address, sockets, processes
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=20)


def _secret_flags(tmp_path, secrets: str, index: int) -> list[str]:
    """With "secret": nodes 1 and 3 share a cluster secret, node 2 has another one."""
    if not secrets:
        return []
    path = tmp_path / f"cluster-{index}.secret"
    path.write_text("the-cluster-secret-0123456789" if index != 2 else "an-impostor-secret-0123456")
    return ["--cluster-secret-file", str(path)]


def write_prefix(socket_path, keys) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    payloads = [
        torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=generator) for _ in keys
    ]
    with KVStoreClient(socket_path, "writer") as client:
        reservation = client.save("t", keys, PAYLOAD)
        for view, payload in zip(reservation.payloads, payloads, strict=True):
            view.copy_(payload)
        assert client.commit(reservation) == len(keys)
    return payloads


def sees(socket_path, keys) -> bool:
    """Whether that agent's cluster view has caught up with the service's events for `keys`
    (it follows them a few milliseconds behind: lookups there are answered on the host)."""
    with KVStoreClient(socket_path, "probe") as probe:
        return wait_until(lambda: probe.lookup("t", keys).remote == len(keys), timeout_s=10)


def holders(address, keys) -> list[set[str]]:
    with MetadataClient(address) as metadata:
        return [{h.node_id for h in per_key} for per_key in metadata.lookup("t", keys).holders]


@pytest.mark.parametrize("cluster", ["tcp", "ucx"], indirect=True)
def test_a_prefix_saved_through_node_1_is_loaded_through_node_3(cluster):
    address, sockets, _ = cluster
    written = write_prefix(sockets[1], KEYS)
    assert wait_until(lambda: holders(address, KEYS) == [{"node-1"}] * 6, timeout_s=10)
    assert sees(sockets[3], KEYS)

    with KVStoreClient(sockets[3], "reader") as reader:
        counts = reader.lookup("t", KEYS)
        assert (counts.local, counts.remote) == (0, 6)
        loaded = reader.load("t", KEYS, timeout_s=10)
        assert (len(loaded), loaded.remote_blocks) == (6, 6)
        assert all(torch.equal(a, b) for a, b in zip(loaded.payloads, written, strict=True))
        reader.release(loaded)
        assert reader.lookup("t", KEYS).local == 6, "node 3 keeps a local replica"

    assert wait_until(lambda: holders(address, KEYS) == [{"node-1", "node-3"}] * 6)
    assert sees(sockets[2], KEYS)
    with KVStoreClient(sockets[2], "second-reader") as reader:
        loaded = reader.load("t", KEYS, timeout_s=10)
        assert len(loaded) == 6 and loaded.remote_blocks == 6
        assert all(torch.equal(a, b) for a, b in zip(loaded.payloads, written, strict=True))
        reader.release(loaded)


@pytest.mark.parametrize("cluster", ["tcp"], indirect=True)
def test_a_dead_holder_costs_a_miss_within_the_timeout(cluster):
    address, sockets, processes = cluster
    write_prefix(sockets[1], KEYS)
    assert wait_until(lambda: len(holders(address, KEYS)) == 6, timeout_s=10)
    processes[1].send_signal(signal.SIGKILL)  # node-1 dies; its lease is still alive
    processes[1].wait()
    with KVStoreClient(sockets[3], "reader") as reader:
        started = time.monotonic()
        loaded = reader.load("t", KEYS, timeout_s=2)
        assert len(loaded) == 0 and time.monotonic() - started < 5
        assert reader.lookup("t", KEYS, local_only=True).local == 0


@pytest.mark.parametrize("cluster", ["tcp"], indirect=True)
def test_a_block_rotten_on_the_holders_disk_is_purged_unpublished_and_missed(cluster, tmp_path):
    address, sockets, _ = cluster
    written = write_prefix(sockets[1], KEYS[:2])
    # Push both blocks down to node 1's disk tier by filling its 16-page arena with others.
    filler = chunk_keys(Namespace("sha256:model", "filler"), range(256 * 16), 256)
    write_prefix(sockets[1], filler)
    assert wait_until(lambda: {"disk"} == tiers_of(address, KEYS[1]), timeout_s=10)
    data_file = tmp_path / "disk-1" / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    offset = raw.find(written[1][:4096].numpy().tobytes())
    assert offset > 0
    with data_file.open("r+b") as handle:  # bit rot under the running agent
        handle.seek(offset + 100)
        handle.write(bytes([raw[offset + 100] ^ 0xFF]))

    assert sees(sockets[3], KEYS[:2])
    with KVStoreClient(sockets[3], "reader") as reader:
        loaded = reader.load("t", KEYS[:2], timeout_s=5)
        assert len(loaded) == 1, "block 0 arrives; rotten block 1 is a miss"
        assert torch.equal(loaded.payloads[0], written[0])
        reader.release(loaded)
    assert wait_until(lambda: "node-1" not in _holders_of(address, KEYS[1]), timeout_s=10)


def tiers_of(address, key) -> set[str]:
    with MetadataClient(address) as metadata:
        found = metadata.lookup("t", [key]).holders
        return {h.tier for h in found[0]} if found else set()


def _holders_of(address, key) -> set[str]:
    with MetadataClient(address) as metadata:
        found = metadata.lookup("t", [key]).holders
        return {h.node_id for h in found[0]} if found else set()


@pytest.mark.parametrize("cluster", ["tcp+secret", "ucx+secret"], indirect=True)
def test_only_agents_that_share_the_cluster_secret_serve_each_other(cluster):
    address, sockets, _ = cluster
    written = write_prefix(sockets[1], KEYS)
    assert wait_until(lambda: holders(address, KEYS) == [{"node-1"}] * 6, timeout_s=10)
    assert sees(sockets[2], KEYS) and sees(sockets[3], KEYS)
    with KVStoreClient(sockets[2], "impostor") as impostor:  # another secret: nothing
        assert impostor.lookup("t", KEYS).remote == 6, "the metadata service knows the holder"
        assert len(impostor.load("t", KEYS, timeout_s=3)) == 0
    with KVStoreClient(sockets[3], "reader") as reader:  # the same secret: the prefix
        loaded = reader.load("t", KEYS, timeout_s=10)
        assert len(loaded) == 6
        assert all(torch.equal(a, b) for a, b in zip(loaded.payloads, written, strict=True))
        reader.release(loaded)
