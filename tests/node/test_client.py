"""The client API against a real node agent, narrated: save in place, look up, load in place,
release; several worker processes share one agent; a dead worker leaks no pins."""

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore import framing
from kvstore.client import MAX_CALLS_SENT, KVStoreClient, LookupCounts
from kvstore.errors import ConfigError, NotFoundError, UnavailableError
from kvstore.keys import Namespace, chunk_keys
from kvstore.owned import owned_key
from kvstore.v1 import agent_pb2 as pb
from tests.metadata.servers import wait_until
from tests.node.agents import running_agent

NS = Namespace("sha256:model", "layout")
KEYS = chunk_keys(NS, range(256 * 8), 256)
PAYLOAD = 100_000


def save_chain(client, keys, fill=lambda i: i + 1, tenant="t"):
    reservation = client.save(tenant, keys, PAYLOAD)
    for index, view in enumerate(reservation.payloads):
        if view is not None:
            view.fill_(fill(index))
    return client.commit(reservation)


def test_a_worker_saves_in_place_and_another_loads_in_place(tmp_path):
    with running_agent(tmp_path) as agent:
        with KVStoreClient(agent.config.socket_path, "writer") as writer:
            assert writer.lookup("t", KEYS).total == 0
            assert save_chain(writer, KEYS[:5]) == 5
        with KVStoreClient(agent.config.socket_path, "reader") as reader:
            assert reader.lookup("t", KEYS) == LookupCounts(local=5, remote=0)
            loaded = reader.load("t", KEYS)
            assert len(loaded) == 5 and loaded.local_blocks == 5
            assert [int(view[0]) for view in loaded.payloads] == [1, 2, 3, 4, 5]
            assert all(view.numel() == PAYLOAD for view in loaded.payloads)
            assert agent.store.pins_held() == 5
            with agent.store.read(owned_key("t", KEYS[2])) as stored:
                assert stored.data_ptr() != loaded.payloads[2].data_ptr()  # another mapping
                assert torch.equal(stored, loaded.payloads[2])  # of the same bytes
            reader.release(loaded)
            assert agent.store.pins_held() == 0
            with pytest.raises(NotFoundError, match="no load"):
                reader.release(loaded)


def test_a_release_naming_a_corrupt_block_purges_it_and_spares_a_good_one(tmp_path):
    """A worker whose copy of a block failed its checksum names it at release: the agent
    checksums the stored bytes itself, purges the corrupt block (no later load gets it) and
    keeps a good one named by a mistaken or hostile worker."""
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:3])
        with agent.store.read(owned_key("t", KEYS[1])) as stored:
            stored[PAYLOAD // 2] += 1  # the arena page's bytes no longer match its checksum
        loaded = client.load("t", KEYS[:3], verify=False)
        client.release(loaded, suspect=[0, 1, 1, 7])  # 7: past the load, ignored
        assert client.lookup("t", KEYS[:3], local_only=True).total == 1
        assert agent.store.checksum_failures == 1 and agent.store.pins_held() == 0
        assert len(client.load("t", KEYS[:3])) == 1


def test_saving_keys_already_stored_reserves_only_the_new_ones(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:3])
        reservation = client.save("t", KEYS[:6], PAYLOAD)
        assert [view is not None for view in reservation.payloads] == [False] * 3 + [True] * 3
        assert client.commit(reservation) == 3
        assert client.lookup("t", KEYS).local == 6


def test_an_aborted_save_leaves_nothing_readable(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        reservation = client.save("t", KEYS[:2], PAYLOAD)
        client.abort(reservation)
        assert client.lookup("t", KEYS).total == 0
        assert agent.store.usage()["host"]["used_pages"] == 0


def test_a_corrupted_arena_page_ends_the_loaded_prefix(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:4])
        loaded = client.load("t", KEYS)
        client.release(loaded)
        loaded.payloads[2][10] += 1  # a stray write into the shared arena
        again = client.load("t", KEYS)
        assert len(again) == 2, "the corrupt block and those after it are misses"
        client.release(again)


def test_async_load_and_commit(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        reservation = client.save("t", KEYS[:3], PAYLOAD)
        for view in reservation.payloads:
            view.fill_(9)
        assert client.commit_async(reservation).result(timeout=10) == 3
        loaded = client.load_async("t", KEYS[:3]).result(timeout=10)
        assert len(loaded) == 3
        client.release(loaded)


def test_bad_requests_get_clear_errors_and_the_agent_keeps_serving(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        with pytest.raises(ConfigError, match="16 bytes"):
            client.lookup("t", [b"short"])
        with pytest.raises(ConfigError, match="does not fit a host page"):
            client.save("t", KEYS[:1], 2 << 20)
        with pytest.raises(ConfigError, match="tenant"):
            client.save("", KEYS[:1], 10)
        assert client.lookup("t", KEYS).total == 0


def test_no_agent_is_unavailable(tmp_path):
    with pytest.raises(UnavailableError, match="no node agent"):
        KVStoreClient(tmp_path / "absent.sock")


def test_an_agent_that_never_answers_is_unavailable_within_the_client_timeout(tmp_path):
    import socket
    import time

    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()  # accepts (the kernel's backlog), never answers the hello
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="node agent connection failed"):
            KVStoreClient(path, timeout_s=0.3)
        assert 0.25 < time.monotonic() - started < 2.0


def test_a_call_polls_for_its_answer_only_briefly_then_sleeps(tmp_path):
    """The client polls for an answer for answer_spin_us, then sleeps on it: waiting out a
    silent agent's 0.3 s costs its thread a few milliseconds of CPU, not 0.3 s."""
    import socket
    import time

    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        cpu_before, started = time.thread_time(), time.monotonic()
        with pytest.raises(UnavailableError, match="node agent connection failed"):
            KVStoreClient(path, timeout_s=0.3, answer_spin_us=1000)
        cpu_s = time.thread_time() - cpu_before
        assert time.monotonic() - started > 0.25 and cpu_s < 0.1


def test_a_client_that_never_polls_gets_the_same_answers(tmp_path):
    with running_agent(tmp_path) as agent:
        with KVStoreClient(agent.config.socket_path, answer_spin_us=0) as sleeper:
            assert save_chain(sleeper, KEYS[:3]) == 3
            assert sleeper.lookup("t", KEYS) == LookupCounts(local=3, remote=0)
        with pytest.raises(ConfigError, match="answer_spin_us"):
            KVStoreClient(agent.config.socket_path, answer_spin_us=-1)


def test_each_call_polls_for_its_answer_as_long_as_the_client_was_told(tmp_path, answer_polls):
    with running_agent(tmp_path) as agent:
        with KVStoreClient(agent.config.socket_path) as client:
            client.lookup("t", KEYS[:4])
            assert answer_polls == [1e-4, 1e-4]  # the hello, the lookup
        answer_polls.clear()
        with KVStoreClient(agent.config.socket_path, answer_spin_us=0) as sleeper:
            sleeper.lookup("t", KEYS[:4])
            assert answer_polls == []
        with pytest.raises(ConfigError, match=r"answer_spin_us must be in \[0, 10000\]"):
            KVStoreClient(agent.config.socket_path, answer_spin_us=10_001)


def test_polling_for_a_socket_stops_at_its_bound_or_once_readable():
    import select
    import socket
    import time

    left, right = socket.socketpair()
    with left, right:
        poller = select.poll()
        poller.register(left, select.POLLIN)
        started = time.perf_counter()
        assert not framing.spin_until_readable(poller, 0.002)
        assert 0.002 <= time.perf_counter() - started < 0.5
        right.send(b"x")
        assert framing.spin_until_readable(poller, 10.0)


_DYING_WORKER = textwrap.dedent(
    """
    import sys, time
    from kvstore.client import KVStoreClient
    from kvstore.keys import Namespace, chunk_keys
    keys = chunk_keys(Namespace("sha256:model", "layout"), range(256 * 8), 256)
    client = KVStoreClient(sys.argv[1], "doomed")
    loaded = client.load("t", keys)
    reservation = client.save("t", keys[5:7], 1000)
    print(len(loaded), flush=True)
    time.sleep(60)
    """
)


def test_a_worker_killed_holding_pins_and_reservations_leaks_nothing(tmp_path):
    with running_agent(tmp_path) as agent:
        with KVStoreClient(agent.config.socket_path) as client:
            save_chain(client, KEYS[:5])
        worker = subprocess.Popen(
            [sys.executable, "-c", _DYING_WORKER, str(agent.config.socket_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert worker.stdout.readline().strip() == "5"
        assert agent.store.pins_held() == 5
        assert agent.store.usage()["host"]["used_pages"] == 7
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert wait_until(lambda: agent.store.pins_held() == 0)
        assert wait_until(lambda: agent.store.usage()["host"]["used_pages"] == 5)


def test_pins_of_the_local_prefix_are_released_when_the_remote_part_fails(tmp_path):
    """Regression: a fetch that raised left the local prefix pinned under no load id."""
    from kvstore.node.identity import ALL_TENANTS, PeerCredentials, WorkerIdentity
    from kvstore.node.session import RequestCounters, WorkerSession

    class FailingFetcher:
        def fetch(self, tenant, keys, timeout_s):
            raise ConfigError("the metadata service refused the tenant")

    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:2])
        identity = WorkerIdentity(PeerCredentials(0, 0, 0), frozenset({ALL_TENANTS}), "test")
        session = WorkerSession(agent.store, FailingFetcher(), RequestCounters(), identity, 64)
        with pytest.raises(ConfigError):
            session.load("t", KEYS[:4], timeout_s=1)
        session.close()
        assert agent.store.pins_held() == 0


def test_a_desynchronised_connection_is_never_reused(tmp_path):
    """Regression: after a timeout, a late answer could be read as the next call's answer."""
    with running_agent(tmp_path) as agent:
        client = KVStoreClient(agent.config.socket_path)
        stray = pb.AgentRequest(request_id=999_999, stats=pb.AgentStatsRequest())
        framing.send_message(client._sock, stray)  # its answer now precedes the next call's
        with pytest.raises(UnavailableError, match="desynchronised"):
            client.lookup("t", KEYS)
        assert client.broken
        with pytest.raises(UnavailableError, match="reconnect"):
            client.lookup("t", KEYS)
        client.close()


def test_copy_to_verifies_the_copy_it_makes(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:2], fill=lambda i: 0x11)
        loaded = client.load("t", KEYS[:2], verify=False)
        destination = torch.empty(PAYLOAD, dtype=torch.uint8)
        assert loaded.copy_to(0, destination) and bool((destination == 0x11).all())
        loaded.payloads[1][5] = 0x22  # the page changed under the view
        assert not loaded.copy_to(1, destination), "a changed page is a miss, never data"
        client.release(loaded)


def test_a_save_whose_keys_are_not_a_chain_is_refused(tmp_path):
    """A save naming a key as its own parent (or a key twice) was accepted, and prefix-lru
    never evicted blocks whose parent claims form a cycle: one worker filled the arena with
    unevictable blocks and every tenant's saves were refused."""
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        for keys, parent in ((KEYS[:2], KEYS[0]), (KEYS[:2], KEYS[1]), ([KEYS[0], KEYS[0]], None)):
            with pytest.raises(ConfigError, match="each key once, none its own ancestor"):
                client.save("t", keys, PAYLOAD, first_parent=parent)
        assert agent.store.pins_held() == 0 and save_chain(client, KEYS[:2]) == 2


def test_a_corrupt_block_header_is_a_miss_purged_and_leaks_no_pin(tmp_path):
    """A header byte flipped in the arena: every load raised (ChecksumError) with its pins
    taken and never released, so the block was never purged and the prefix stayed broken."""
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:3])
        host = agent.store.slots[0].tier
        host.pages[host.page_index(owned_key("t", KEYS[1])), 0] ^= 0xFF  # the header's magic
        loaded = client.load("t", KEYS[:3], verify=False)
        assert len(loaded) == 1
        client.release(loaded)
        assert agent.store.pins_held() == 0 and agent.store.checksum_failures == 1
        assert client.lookup("t", KEYS[:3]).total == 1


def test_calls_sent_without_waiting_are_answered_in_order_before_the_next(tmp_path, caplog):
    """Pipelined calls: a release and an abort sent without waiting, a save sent ahead of a
    load: each answer reaches its own call, the unwaited ones' effects are done by the time
    the next answer arrives, and an unwaited call's error is logged, not raised on another."""
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:3])
        loaded = client.load("t", KEYS[:3])
        client.release(loaded, wait=False)
        reservation = client.save_sent("t", KEYS[3:5], PAYLOAD)  # sent; its answer kept
        second = client.load("t", KEYS[:3])  # reads the release's and the save's answers
        assert len(second) == 3 and agent.store.pins_held() == 3
        client.release(second, wait=False)
        reserved = reservation()
        assert len(reserved.reserved_keys()) == 2
        client.abort(reserved, wait=False)
        with caplog.at_level("WARNING", logger="kvstore.client"):
            client.release(loaded, wait=False)  # released already: NOT_FOUND, logged
            assert client.lookup("t", KEYS) == LookupCounts(local=3, remote=0)
        assert agent.store.pins_held() == 0
        assert "release failed" in caplog.text and "no load" in caplog.text


def test_unwaited_calls_past_the_bound_read_the_oldest_answers_first(tmp_path):
    """More calls sent without waiting than MAX_CALLS_SENT: the client reads the oldest
    answers as it goes, so neither side's socket fills and no answer is lost."""
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        save_chain(client, KEYS[:1])
        for _ in range(3 * MAX_CALLS_SENT):
            client.release(client.load("t", KEYS[:1]), wait=False)
        assert client.lookup("t", KEYS[:1]).local == 1
        assert agent.store.pins_held() == 0
