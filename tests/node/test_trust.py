"""The control socket trusts nothing a worker says about itself, narrated: identity comes from
the connection (SO_PEERCRED or a credential token), a worker sees and writes only its tenants'
blocks, pins outlive a broken connection as long as the worker may still be copying, and every
connection, frame and pin is bounded with a clear error."""

import os
import socket
import struct
import time

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.errors import AuthError, CapacityError, ConfigError, PermissionDeniedError
from kvstore.keys import Namespace, chunk_keys
from kvstore.node.agent import NodeAgent, NodeConfig
from kvstore.owned import owned_key
from kvstore.v1 import agent_pb2 as pb
from tests.metadata.servers import wait_until
from tests.node.agents import SMALL, running_agent, start_node_process

ALICE_TOKEN, BOB_TOKEN = "alice-token-0123456789", "bob-token-0123456789ab"
KEYS = chunk_keys(Namespace("sha256:model", "layout", tenant="alice", salt="s"), range(1024), 256)
BOB_KEYS = chunk_keys(Namespace("sha256:model", "layout", tenant="bob"), range(1024), 256)
PAYLOAD = 4096


def credentials(tmp_path, *lines: str):
    path = tmp_path / "workers.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def token_file(tmp_path, name: str, token: str):
    path = tmp_path / f"{name}.token"
    path.write_text(token + "\n")
    return path


def save(client, tenant, keys, fill=7):
    reservation = client.save(tenant, keys, PAYLOAD)
    for view in reservation.payloads:
        if view is not None:
            view.fill_(fill)
    return client.commit(reservation)


@pytest.fixture
def two_tenants(tmp_path):
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice", f"token:{BOB_TOKEN} bob")
    with running_agent(tmp_path, worker_credentials=table) as agent:
        alice = KVStoreClient(
            agent.config.socket_path,
            "a",
            credential_file=token_file(tmp_path, "alice", ALICE_TOKEN),
        )
        bob = KVStoreClient(
            agent.config.socket_path, "b", credential_file=token_file(tmp_path, "bob", BOB_TOKEN)
        )
        yield agent, alice, bob
        alice.close()
        bob.close()


def test_a_worker_cannot_look_up_load_or_save_another_tenants_keys(two_tenants):
    agent, alice, bob = two_tenants
    assert save(alice, "alice", KEYS) == len(KEYS)
    assert list(alice.info.tenants) == ["alice"]
    for call in (
        lambda: bob.lookup("alice", KEYS),
        lambda: bob.load("alice", KEYS),
        lambda: bob.save("alice", KEYS, PAYLOAD),
    ):
        with pytest.raises(PermissionDeniedError, match="not 'alice'"):
            call()
    # Under its own tenant, bob's worker sees alice's blocks as absent, not as present.
    assert bob.lookup("bob", KEYS).total == 0
    assert len(bob.load("bob", KEYS)) == 0
    assert agent.store.pins_held() == 0


def test_a_worker_that_proves_nothing_is_refused(tmp_path):
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice", "uid:4242 bob")
    with running_agent(tmp_path, worker_credentials=table) as agent:
        with pytest.raises(AuthError, match="uid 0 / gid 0 is not allowed"):
            KVStoreClient(agent.config.socket_path)
        wrong = token_file(tmp_path, "wrong", "not-the-token-of-anyone")
        with pytest.raises(AuthError, match="not valid"):
            KVStoreClient(agent.config.socket_path, credential_file=wrong)
        assert agent.control.refused["auth"] == 2
        assert not agent.control.sessions


def test_without_a_credentials_file_only_the_agents_own_user_may_connect(tmp_path):
    with running_agent(tmp_path) as agent, KVStoreClient(agent.config.socket_path) as client:
        assert list(client.info.tenants) == ["*"]
        assert client.lookup("anyone", KEYS).total == 0
    table = credentials(tmp_path, "uid:4242 alice")  # not us: we are refused
    with running_agent(tmp_path, "node-b", worker_credentials=table) as agent:
        with pytest.raises(AuthError):
            KVStoreClient(agent.config.socket_path)


def test_pins_outlive_a_broken_connection_until_the_lease_runs_out(tmp_path):
    with running_agent(tmp_path, orphan_pin_ttl_s=1.5) as agent:
        with KVStoreClient(agent.config.socket_path) as writer:
            save(writer, "t", KEYS)
        reader = KVStoreClient(agent.config.socket_path)
        loaded = reader.load("t", KEYS)
        reader._break()  # e.g. a timeout: this process may still be reading the views
        assert wait_until(lambda: len(agent.control.orphans) == 1)
        assert agent.store.pins_held() == len(KEYS) and len(loaded) == len(KEYS)
        assert wait_until(lambda: agent.store.pins_held() == 0, timeout_s=5)
        reader.close()


def test_a_worker_process_that_died_frees_its_pins_at_once(tmp_path):
    process, socket_path = start_node_process(tmp_path, "node-a")
    try:
        with KVStoreClient(socket_path) as writer:
            save(writer, "t", KEYS)
        worker = _spawn_loader(socket_path)
        assert worker.stdout.readline().strip() == "loaded"
        worker.kill()
        worker.wait()
        started = time.monotonic()
        with KVStoreClient(socket_path) as probe:
            assert wait_until(lambda: '"pins": 0' in probe.stats(), timeout_s=5)
        assert time.monotonic() - started < 3, "a dead worker's pins wait for no lease"
    finally:
        process.kill()
        process.wait()


def _spawn_loader(socket_path):
    import subprocess
    import sys

    code = (
        "import sys; from kvstore.client import KVStoreClient; from tests.node.test_trust import"
        f" KEYS; c = KVStoreClient({str(socket_path)!r}); c.load('t', KEYS); print('loaded',"
        " flush=True); sys.stdin.read()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_workers_and_pins_per_worker_are_capped(tmp_path):
    with running_agent(tmp_path, max_workers=2, max_pins_per_worker=3) as agent:
        first = KVStoreClient(agent.config.socket_path)
        second = KVStoreClient(agent.config.socket_path)
        with pytest.raises(CapacityError, match="max_workers"):
            KVStoreClient(agent.config.socket_path)
        save(first, "t", KEYS[:3])
        with pytest.raises(CapacityError, match="limit per worker is 3"):
            second.load("t", KEYS)
        assert len(second.load("t", KEYS[:3])) == 3
        assert agent.control.refused["workers"] == 1
        first.close()
        second.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_stalled_frames_cost_no_memory_and_oversized_ones_are_refused(tmp_path):
    process, socket_path = start_node_process(tmp_path, "node-a")
    try:
        with KVStoreClient(socket_path):
            pass  # the agent is warm
        before = _rss_bytes(process.pid)
        stalled = []
        for _ in range(8):  # each announces a whole frame (4 MiB) and sends 10 bytes of it
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(str(socket_path))
            conn.sendall(struct.pack("<I", (4 << 20) - 1) + b"x" * 10)
            stalled.append(conn)
        oversized = socket.socket(socket.AF_UNIX)
        oversized.connect(str(socket_path))
        oversized.sendall(struct.pack("<I", 64 << 20))
        oversized.settimeout(5)
        assert b"exceeds" in oversized.recv(4096) or oversized.recv(1) == b""
        time.sleep(0.5)
        grown = _rss_bytes(process.pid) - before
        assert grown < 8 << 20, f"stalled frames grew the agent by {grown >> 20} MiB"
        with KVStoreClient(socket_path) as client:  # the agent still serves
            assert client.lookup("t", KEYS).total == 0
        for conn in stalled:
            conn.close()
    finally:
        process.kill()
        process.wait()


def test_a_frame_that_stalls_is_dropped_by_its_deadline(tmp_path):
    with running_agent(tmp_path, control_frame_timeout_s=0.5) as agent:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(str(agent.config.socket_path))
        conn.sendall(struct.pack("<I", 100) + b"x")  # then nothing
        conn.settimeout(5)
        started = time.monotonic()
        answer = b"".join(iter(lambda: conn.recv(4096), b""))  # until the agent closes
        assert b"incomplete by its deadline" in answer
        assert time.monotonic() - started < 3
        assert wait_until(lambda: agent.control.connections == 0)
        assert agent.control.refused["frames"] == 1


def test_a_worker_that_never_says_hello_is_refused_with_a_deadline_status(tmp_path):
    with running_agent(tmp_path, control_frame_timeout_s=0.5) as agent:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(str(agent.config.socket_path))  # then not a byte
        conn.settimeout(5)
        answer = b"".join(iter(lambda: conn.recv(4096), b""))  # until the agent closes
        response = pb.AgentResponse.FromString(answer[4:])
        assert response.error.code == "DEADLINE_EXCEEDED"
        assert wait_until(lambda: agent.control.connections == 0)
        assert agent.control.refused["frames"] == 1


def test_a_socket_directory_others_could_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    agent = NodeAgent(
        NodeConfig(node_id="n", socket_path=shared / "agent.sock", **SMALL, transfer="none")
    )
    with pytest.raises(ConfigError, match="writable by group or others"):
        agent.start()
    agent.stop()
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o750)
    os.chown(foreign, 4242, 4242)
    agent = NodeAgent(
        NodeConfig(node_id="n", socket_path=foreign / "agent.sock", **SMALL, transfer="none")
    )
    with pytest.raises(ConfigError, match="belongs to uid 4242"):
        agent.start()
    agent.stop()


_OTHER_USER_WORKER = """
import json, os, sys
from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.errors import PermissionDeniedError
from tests.node.test_trust import BOB_KEYS, KEYS, save
socket_path, arena, nobody = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(nobody); os.setuid(nobody)  # imports done: become another user
out = {"uid": os.getuid()}
try:
    open(arena, "rb")
    out["arena"] = "readable"
except PermissionError:
    out["arena"] = "denied"
with KVStoreClient(socket_path, "bob") as bob:
    out["access"] = bob.access
    out["sees_alice"] = bool((bob._mapping.flat == 0xA1).any())
    try:
        bob.lookup("alice", KEYS)
    except PermissionDeniedError:
        out["alice_lookup"] = "denied"
    out["saved"] = save(bob, "bob", BOB_KEYS[:2], fill=0xB0)
    loaded = bob.load("bob", BOB_KEYS[:2])
    out["loaded_ok"] = all(bool((p == 0xB0).all()) for p in loaded.payloads) and len(loaded) == 2
    bob.release(loaded)
print(json.dumps(out))
"""


def test_a_worker_of_another_user_works_only_through_private_copies(tmp_path):
    """Pages of one tenant are not readable by another tenant's worker: the arena file is the
    agent's alone, and a private worker maps a buffer that holds only what it loaded."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    nobody = 65534
    directory = Path(tempfile.mkdtemp(prefix="kvstore-trust-"))
    os.chmod(directory, 0o755)  # other users may reach the socket; the agent decides the rest
    table = credentials(tmp_path, "uid:0 alice shared", f"uid:{nobody} bob")
    try:
        config = NodeConfig(
            node_id="n",
            socket_path=directory / "agent.sock",
            **SMALL,
            transfer="none",
            worker_credentials=table,
        )
        agent = NodeAgent(config)
        agent.start()
        os.chmod(config.socket_path, 0o666)  # in production: a group both users share
        with KVStoreClient(config.socket_path) as alice:
            assert alice.access == "shared"
            save(alice, "alice", KEYS, fill=0xA1)
        arena = f"/dev/shm/{agent.store.slots[0].tier.arena_name}"
        worker = subprocess.run(
            [sys.executable, "-c", _OTHER_USER_WORKER, str(config.socket_path), arena, str(nobody)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[2],
        )
        assert worker.returncode == 0, worker.stderr
        assert json.loads(worker.stdout) == {
            "uid": nobody,
            "arena": "denied",
            "access": "private",
            "sees_alice": False,
            "alice_lookup": "denied",
            "saved": 2,
            "loaded_ok": True,
        }
        assert agent.store.pins_held() == 0
        agent.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_private_workers_load_is_verified_as_it_is_copied_out(two_tenants):
    agent, alice, _ = two_tenants
    assert alice.access == "private"
    save(alice, "alice", KEYS, fill=0x33)
    host = agent.store.slots[0].tier
    host.pages[host.page_index(owned_key("alice", KEYS[2])), HEADER_BYTES + 10] ^= (
        0xFF  # payload bytes rot
    )
    loaded = alice.load("alice", KEYS)
    assert len(loaded) == 2 and all(bool((p == 0x33).all()) for p in loaded.payloads)
    assert agent.store.pins_held() == 0, "a private worker never holds arena pins"
    alice.release(loaded)
    # the rotten block is purged (it was served as a miss, and kept hot, to every later load)
    assert alice.lookup("alice", KEYS).total == 2 and agent.store.checksum_failures == 1


def test_a_connection_that_never_says_hello_holds_no_slot(tmp_path):
    with running_agent(tmp_path, max_workers=1, control_frame_timeout_s=0.5) as agent:
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(str(agent.config.socket_path))  # and says nothing
        assert wait_until(lambda: agent.control.connections == 1)
        assert wait_until(lambda: agent.control.connections == 0, timeout_s=5)
        with KVStoreClient(agent.config.socket_path) as client:  # the one slot is free again
            assert client.lookup("t", KEYS).total == 0
        silent.close()


def test_worker_credentials_with_an_open_transfer_port_are_refused_at_start(tmp_path):
    """Tenants kept apart on the control socket would meet on the transfer port: without a
    cluster secret any local process could fetch any tenant's blocks there by naming it."""
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice")
    for transfer in ("tcp", "ucx"):
        with pytest.raises(ConfigError, match="give --cluster-secret-file"):
            NodeConfig(
                node_id="n",
                socket_path=tmp_path / "n.sock",
                transfer=transfer,
                worker_credentials=table,
            )
    secret = tmp_path / "cluster.secret"
    secret.write_text("s" * 32)
    NodeConfig(
        node_id="n",
        socket_path=tmp_path / "n.sock",
        transfer="tcp",
        worker_credentials=table,
        cluster_secret_file=secret,
    )


def test_a_worker_whose_broken_connections_hold_its_pin_limit_is_refused_until_freed(tmp_path):
    """Broken sessions of shared-arena workers keep their pins while the process lives; one
    process that saved and broke its connection in a loop held the whole arena. Now its next
    connection is refused (RESOURCE_EXHAUSTED) while its orphans hold max_pins_per_worker
    pages, and it connects again once their pins time out."""
    with running_agent(tmp_path, max_pins_per_worker=2, orphan_pin_ttl_s=2.0) as agent:
        path = agent.config.socket_path
        worker = KVStoreClient(path, "loop")
        worker.save("t", KEYS[:2], PAYLOAD)  # reserved, never committed
        worker._break()  # this process lives on: the session is orphaned, its pages held
        assert wait_until(lambda: len(agent.control.orphans) == 1)
        with pytest.raises(CapacityError, match=r"broken connections \(uid:\d+\) still hold 2"):
            KVStoreClient(path, "loop")
        assert agent.stats()["refused"]["orphan_pins"] == 1
        assert wait_until(lambda: len(agent.control.orphans) == 0, timeout_s=6)
        with KVStoreClient(path, "loop") as again:
            assert save(again, "t", KEYS[:2]) == 2
        worker.close()


def test_a_private_workers_broken_session_frees_its_pages_at_once(tmp_path):
    """A private worker never maps arena pages (it has copies in a buffer of its own): its
    broken session holds nothing for it, so nothing is kept."""
    table = credentials(tmp_path, f"token:{ALICE_TOKEN} alice")
    with running_agent(tmp_path, worker_credentials=table) as agent:
        token = token_file(tmp_path, "alice", ALICE_TOKEN)
        worker = KVStoreClient(agent.config.socket_path, "alice", credential_file=token)
        assert worker.access == "private"
        worker.save("alice", KEYS[:2], PAYLOAD)
        worker._break()
        assert wait_until(lambda: agent.store.slots[0].tier.used_pages == 0)
        assert len(agent.control.orphans) == 0
        worker.close()
