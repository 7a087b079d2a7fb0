"""The node agent with its metadata service: publishing, arena overflow to disk, restart with
re-publishing, the metadata service going down and coming back, concurrent workers."""

import multiprocessing
import urllib.request

import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import CapacityError
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import MetadataClient
from kvstore.owned import owned_key, owned_keys
from tests.metadata.servers import client_for, running_server, wait_until
from tests.node.agents import running_agent
from tests.node.test_client import PAYLOAD, save_chain

KEYS = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 40), 256)


def published(metadata: MetadataClient, keys, tenant="t") -> int:
    return metadata.lookup(tenant, keys).prefix_length


def test_saved_blocks_are_published_and_evicted_ones_move_to_disk(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as metadata:
        address = f"127.0.0.1:{server.port}"
        settings = {
            "metadata_address": address,
            "disk_dir": tmp_path / "disk",
            "host_capacity_bytes": 8 << 20,
            "host_policy": "lru",
        }
        with running_agent(tmp_path, **settings) as agent:
            with KVStoreClient(agent.config.socket_path) as client:
                for start in (0, 4, 8):  # 8 host pages: the first 4 blocks go down to disk
                    save_chain(client, KEYS[start : start + 4], fill=lambda i, s=start: s + i + 1)
                assert wait_until(lambda: published(metadata, KEYS) == 12)
                tiers = {agent.store.tier_of(k) for k in owned_keys("t", KEYS[:4])}
                assert tiers == {"disk"} and agent.store.tier_of(owned_key("t", KEYS[11])) == "host"
                holders = metadata.lookup("t", KEYS).holders
                assert {h.tier for h in holders[0]} == {"disk"}
                loaded = client.load("t", KEYS)  # disk blocks are promoted into the arena
                assert len(loaded) == 8, "only 8 fit in the arena at once"
                assert [int(v[0]) for v in loaded.payloads] == list(range(1, 9))
                client.release(loaded)


def test_a_restarted_agent_finds_its_disk_blocks_and_publishes_them_again(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as metadata:
        settings = {
            "metadata_address": f"127.0.0.1:{server.port}",
            "disk_dir": tmp_path / "disk",
            "host_capacity_bytes": 4 << 20,
            "host_policy": "lru",
        }
        with running_agent(tmp_path, **settings) as agent:
            with KVStoreClient(agent.config.socket_path) as client:
                for start in (0, 4, 8):
                    save_chain(
                        client, KEYS[start : min(start + 4, 10)], fill=lambda i, s=start: s + i + 1
                    )
            assert wait_until(lambda: published(metadata, KEYS) == 10)
        assert published(metadata, KEYS) == 0, "a clean stop deregisters the node"
        with running_agent(tmp_path, **settings) as agent:
            assert agent.store.lookup(owned_keys("t", KEYS)) == 6, (
                "the 6 blocks demoted to disk survived"
            )
            assert wait_until(lambda: published(metadata, KEYS) == 6)
            with KVStoreClient(agent.config.socket_path) as client:
                loaded = client.load("t", KEYS)
                assert [int(v[0]) for v in loaded.payloads] == [1, 2, 3, 4]
                client.release(loaded)


def test_local_hits_are_served_while_the_metadata_service_is_down(tmp_path):
    server_dir = tmp_path / "meta"
    with running_server(server_dir) as server:
        port = server.port
    settings = {"metadata_address": f"127.0.0.1:{port}"}
    with running_agent(tmp_path, **settings) as agent:  # the service is gone already
        with KVStoreClient(agent.config.socket_path) as client:
            save_chain(client, KEYS[:3])
            assert client.lookup("t", KEYS).local == 3
            loaded = client.load("t", KEYS)
            assert len(loaded) == 3
            client.release(loaded)
            assert not agent.link.connected
        # The service comes back on the same port: the agent registers and publishes.
        # its lookup port anywhere: "auto" (the gRPC port + 1) may be another process's now
        again = {"listen": f"127.0.0.1:{port}", "lookup_listen": "127.0.0.1:0"}
        with running_server(server_dir, **again) as server:
            with client_for(server) as metadata:
                assert wait_until(lambda: published(metadata, KEYS) == 3, timeout_s=10)


def test_agent_metrics(tmp_path):
    with running_agent(
        tmp_path, metrics_listen="127.0.0.1:0", max_workers=1, transfer="tcp"
    ) as agent:
        with KVStoreClient(agent.config.socket_path) as client:
            save_chain(client, KEYS[:3])
            client.release(client.load("t", KEYS[:5]))
            with pytest.raises(CapacityError):
                KVStoreClient(agent.config.socket_path)  # over max_workers
        text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics").read()
        text = text.decode()
        for line in (
            'kvstore_agent_blocks{tier="host"} 3.0',
            'kvstore_agent_loaded_blocks_total{source="local"} 3.0',
            'kvstore_agent_loaded_blocks_total{source="miss"} 2.0',
            "kvstore_agent_saved_blocks_total 3.0",
            "kvstore_agent_pins 0.0",
            "kvstore_agent_checksum_failures_total 0.0",
            'kvstore_agent_refused_connections_total{reason="workers"} 1.0',
            "kvstore_agent_orphaned_pages 0.0",
            'kvstore_agent_transfer_events_total{event="connections_refused"} 0.0',
            'kvstore_agent_transfer_events_total{event="batches_cut"} 0.0',
        ):
            assert line in text, line


def _hammer(socket_path: str, worker: int, rounds: int, queue) -> None:
    """Save and load the same chain over and over; report any payload that is not uniform."""
    torn = loads = 0
    with KVStoreClient(socket_path, f"w{worker}") as client:
        for round_ in range(rounds):
            reservation = client.save("t", KEYS[:6], PAYLOAD)
            for index, view in enumerate(reservation.payloads):
                if view is not None:
                    view.fill_(index + 1)
            client.commit(reservation)
            loaded = client.load("t", KEYS[:6])
            loads += len(loaded)
            for index, view in enumerate(loaded.payloads):
                if int(view.min()) != index + 1 or int(view.max()) != index + 1:
                    torn += 1
            client.release(loaded)
            if round_ % 3 == 2:  # make room so that the next round writes again
                client.abort(client.save("t", KEYS[6:8], PAYLOAD))
    queue.put((torn, loads))


def test_several_processes_writing_and_reading_the_same_keys_never_see_torn_blocks(tmp_path):
    with running_agent(tmp_path, host_capacity_bytes=7 << 20) as agent:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        workers = [
            context.Process(target=_hammer, args=(str(agent.config.socket_path), n, 15, queue))
            for n in range(4)
        ]
        for worker in workers:
            worker.start()
        results = [queue.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
        assert sum(torn for torn, _ in results) == 0
        assert sum(loads for _, loads in results) > 0
        assert agent.store.pins_held() == 0


def test_an_agent_that_died_within_its_lease_leaves_no_stale_holdings(tmp_path):
    """Regression: a restarted agent re-registered under the same id and kept the dead
    process's host-tier holdings published, promising blocks it no longer had."""
    with running_server(tmp_path) as server, client_for(server) as metadata:
        settings = {"metadata_address": f"127.0.0.1:{server.port}", "lease_ttl_ms": 60_000}
        with running_agent(tmp_path, **settings) as agent:
            with KVStoreClient(agent.config.socket_path) as client:
                save_chain(client, KEYS[:3])
            assert wait_until(lambda: published(metadata, KEYS) == 3)
            agent.link.stop(deregister=False)  # dies: its lease is still alive for a minute
            agent.link = None
        with running_agent(tmp_path, **settings) as agent:  # same node id, empty arena
            assert wait_until(lambda: agent.link.connected)
            assert published(metadata, KEYS) == 0
