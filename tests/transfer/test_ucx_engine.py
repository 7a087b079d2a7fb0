"""The ucx engine on loopback, narrated: blocks land byte-identical between two real stores,
misses and corrupt blocks never become readable, unreachable peers fail fast, a holder killed
mid-block leaves nothing partial, and a process using UCX idles quietly and exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch

pytest.importorskip("kvstore.transfer.ucx")  # sets UCX's logging defaults before ucxx loads
pytest.importorskip("ucxx")

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError, TransferError
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR
from kvstore.transfer import ucx, ucx_runtime
from kvstore.transfer.ucx import UcxEngine
from tests.sockets import listening_sockets
from tests.transfer.conftest import (
    KEYS,
    LOOPBACK,
    SECRET,
    SMALL_PAGE_BYTES,
    TENANT,
    Pair,
    land,
    new_store,
    payload,
    stored_payload,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLED_PAGE_BYTES = 32 << 20
UCX_DEFAULTS = ("UCX_LOG_FILE", "UCXX_LOG_LEVEL", "UCX_WARN_UNUSED_ENV_VARS")  # the engine's

# A holder in its own process with three 32 MiB blocks; it prints its address and waits to be
# killed. Its engine is not referenced: an engine serves until closed, like a tcp one.
HOLDER_SCRIPT = f"""
import time
from kvstore.block import HEADER_BYTES
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR
from kvstore.transfer.ucx import UcxEngine
from tests.transfer.conftest import KEYS, new_store, payload
store = new_store({KILLED_PAGE_BYTES}, 3)
for n in range(3):
    store.put(KEYS[n], None, payload(n, {KILLED_PAGE_BYTES} - HEADER_BYTES))
print(UcxEngine(tls="tcp", net_devices="lo").serve(store.open_tenant_block), flush=True)
time.sleep(120)
"""

# Uses UCX, including a refused dial, and exits without closing its engines.
EXIT_SCRIPT = """
from kvstore.errors import TransferError
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR
from kvstore.transfer.ucx import UcxEngine
from tests.transfer.conftest import KEYS, Pair, new_store
pair = Pair(new_store(1 << 16, 4), new_store(1 << 16, 4), UcxEngine(), UcxEngine())
keys = pair.put(range(2))
assert pair.land(keys, pair.fetch(keys)) == [True, True]
try:
    pair.client.fetch("127.0.0.1:1", "default", KEYS[2:3], [pair.reader.reserve_page(KEYS[2])], 2.0)
except TransferError:
    print("done", flush=True)
pair.holder.close()
pair.reader.close()
"""


@pytest.mark.parametrize("tls", ["tcp", "tcp,sm,self"])
def test_blocks_land_byte_identical_between_two_stores(make_ucx_pair, tls):
    pair = make_ucx_pair(1 << 20, tls=tls)
    sizes = [1, 4096, 300_000, (1 << 20) - HEADER_BYTES]
    keys = [key for n, size in enumerate(sizes) for key in pair.put([n], size)]

    received = pair.fetch(keys)

    assert received == [HEADER_BYTES + size for size in sizes]
    assert pair.land(keys, received) == [True] * 4
    assert [stored_payload(pair.reader, k) for k in keys] == [
        payload(n, size) for n, size in enumerate(sizes)
    ]
    with pair.holder.open_block(keys[3]) as sent, pair.reader.open_block(keys[3]) as landed:
        assert bytes(sent.numpy()) == bytes(landed.numpy())  # header included


def test_missing_keys_read_as_zero_and_never_land(make_ucx_pair):
    pair = make_ucx_pair()
    pair.put([1, 3])

    received = pair.fetch(KEYS[:5])

    assert received == [0, SMALL_PAGE_BYTES, 0, SMALL_PAGE_BYTES, 0]
    assert pair.land(KEYS[:5], received) == [False, True, False, True, False]
    assert pair.reader.lookup(KEYS[1:2]) == 1 and pair.reader.lookup(KEYS[:1]) == 0


def test_a_payload_altered_in_place_at_the_holder_is_refused_by_the_reader(make_ucx_pair):
    pair = make_ucx_pair()
    keys = pair.put(range(3))
    with pair.holder.open_block(keys[1]) as stored:  # flip a byte, leave the checksum stale
        stored[HEADER_BYTES + 1000] ^= 0xFF

    received = pair.fetch(keys)

    assert received == [SMALL_PAGE_BYTES] * 3
    assert pair.land(keys, received) == [True, False, True]
    assert pair.reader.lookup(keys[1:2]) == 0 and pair.reader.checksum_failures == 1


def test_an_address_nobody_listens_on_raises_at_once(make_ucx_pair, make_store):
    pair, reader = make_ucx_pair(), make_store(SMALL_PAGE_BYTES, 2)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once closed

    started = time.monotonic()
    with pytest.raises(TransferError, match="cannot reach"):
        page = reader.reserve_page(KEYS[0])
        pair.client.fetch(f"127.0.0.1:{port}", TENANT, KEYS[:1], [page], 5.0)

    assert time.monotonic() - started < 2.0  # refused: no need to wait out the 5 s


def test_a_port_that_never_answers_raises_when_the_timeout_ends(make_ucx_pair, make_store):
    pair, reader = make_ucx_pair(), make_store(SMALL_PAGE_BYTES, 2)
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts TCP, never speaks UCX
        started = time.monotonic()
        with pytest.raises(TransferError):
            address = f"127.0.0.1:{mute.getsockname()[1]}"
            pair.client.fetch(address, TENANT, KEYS[:1], [reader.reserve_page(KEYS[0])], 1.0)
        elapsed = time.monotonic() - started

    assert 0.9 < elapsed < 3.0


@pytest.mark.multiprocess
def test_a_holder_killed_mid_block_leaves_zeros_and_nothing_partial(make_store):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    reader, client = make_store(KILLED_PAGE_BYTES, 3), UcxEngine(**LOOPBACK)
    try:
        address = holder.stdout.readline().strip()
        pages = [reader.reserve_page(key) for key in KEYS[:3]]
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            fetching = pool.submit(client.fetch, address, TENANT, KEYS[:3], pages, 20.0)
            wait_until_arriving(fetching, pages[2])  # block 2's header landed, the rest not yet
            holder.send_signal(signal.SIGKILL)
            received = fetching.result(timeout=25.0)
        elapsed = time.monotonic() - started

        assert received == [KILLED_PAGE_BYTES] * 2 + [0]
        assert elapsed < 10.0  # the dead peer is noticed, not waited out
        assert land(reader, KEYS[:3], received) == [True, True, False]
        assert reader.lookup(KEYS[:3]) == 2 and reader.checksum_failures == 0
        with pytest.raises(TransferError):  # the pooled endpoint is dead and so is the port
            client.fetch(address, TENANT, KEYS[2:3], [reader.reserve_page(KEYS[2])], 2.0)
    finally:
        holder.kill()
        holder.wait()
        client.close()
        for arena in SHM_DIR.glob(f"{ARENA_PREFIX}{holder.pid}-*"):  # a killed owner leaves it
            arena.unlink()


def wait_until_arriving(fetching: Future, page: torch.Tensor) -> None:
    deadline = time.monotonic() + 10.0
    while bytes(page[:4].numpy()) != b"KVSB":
        assert not fetching.done(), f"the fetch ended first: {fetching.result()}"
        assert time.monotonic() < deadline, "block 2 never started arriving"
        time.sleep(0.0002)


def test_closing_the_client_mid_fetch_returns_what_arrived(make_ucx_pair):
    stalled, release = threading.Event(), threading.Event()

    def stall_at_block_2(open_block):
        @contextmanager
        def serve(key, tenant):
            if key == KEYS[2]:
                stalled.set()
                release.wait(10.0)
            with open_block(key, tenant) as view:
                yield view

        return serve

    pair = make_ucx_pair(wrap=stall_at_block_2)
    keys = pair.put(range(4))
    try:
        with ThreadPoolExecutor(1) as pool:
            fetching = pool.submit(pair.fetch, keys, 10.0)
            assert stalled.wait(5.0)
            time.sleep(0.3)  # blocks 0 and 1 land
            pair.client.close()
            received = fetching.result(timeout=5.0)
    finally:
        release.set()

    assert received == [SMALL_PAGE_BYTES] * 2 + [0] * 2
    assert pair.land(keys, received) == [True, True, False, False]
    with pytest.raises(TransferError, match="closed"):
        pair.fetch(keys[2:])


def test_ucx_settings_are_per_process_and_must_agree(make_ucx_pair, make_store):
    make_ucx_pair()  # UCX now runs with tls=tcp
    other = UcxEngine(tls="tcp,sm,self", net_devices="lo")

    with pytest.raises(ConfigError, match="must agree"):
        other.serve(make_store(SMALL_PAGE_BYTES, 1).open_tenant_block)
    other.close()
    other.close()


def test_an_idle_engine_does_not_spin_the_cpu(make_ucx_pair):
    pair = make_ucx_pair()
    keys = pair.put(range(2))
    assert pair.land(keys, pair.fetch(keys)) == [True, True]  # a pooled endpoint now waits

    before = time.process_time()
    time.sleep(1.0)

    assert time.process_time() - before < 0.3  # ucxx's default waiting polls a full core


@pytest.mark.multiprocess
def test_a_process_that_never_closes_its_engines_exits_with_a_clean_stdout():
    environment = {name: value for name, value in os.environ.items() if name not in UCX_DEFAULTS}
    # UCXX_LOG_LEVEL=ERROR: the refused dial logs an error, which must not reach stdout
    environment |= {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCXX_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n"  # UCX's and UCXX's logs went to stderr


LOOPBACK_V4 = "0100007F"

# Serves on 127.0.0.1 with neither UCX_NET_DEVICES nor net_devices: the engine picks them.
LISTEN_SCRIPT = """
import os, time
os.environ.pop("UCX_NET_DEVICES", None)
from kvstore.transfer.ucx import UcxEngine
from tests.transfer.conftest import new_store
engine = UcxEngine(tls="tcp")
print(engine.serve(new_store(1 << 16, 2).open_tenant_block, "127.0.0.1"), flush=True)
time.sleep(120)
"""


def test_the_gate_and_ucx_listen_on_the_configured_host_only(make_ucx_pair):
    pair = make_ucx_pair()
    pair.put([0])
    assert pair.fetch(KEYS[:1]) == [SMALL_PAGE_BYTES]  # UCX endpoints both ways exist now
    port = int(pair.address.rsplit(":", 1)[1])

    listening = listening_sockets()

    assert {address for address, bound in listening if bound == port} == {LOOPBACK_V4}
    assert {address for address, _ in listening} == {LOOPBACK_V4}  # UCX's own sockets too


@pytest.mark.multiprocess
def test_serving_picks_the_interface_that_owns_the_host_for_ucx():
    environment = {name: value for name, value in os.environ.items() if name != "UCX_NET_DEVICES"}
    server = subprocess.Popen(
        [sys.executable, "-c", LISTEN_SCRIPT],
        cwd=REPO_ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = server.stdout.readline().strip()
        listening = listening_sockets(server.pid)
    finally:
        server.kill()
        server.wait()
        for arena in SHM_DIR.glob(f"{ARENA_PREFIX}{server.pid}-*"):
            arena.unlink(missing_ok=True)

    assert address.startswith("127.0.0.1:")
    assert len(listening) >= 2  # the gate and UCX's tcp transport
    assert {address for address, _ in listening} == {LOOPBACK_V4}  # not eth0's, not 0.0.0.0


def test_the_ucx_devices_follow_the_serving_host():
    assert ucx_runtime.net_devices_for("127.0.0.1") == "lo"  # no RDMA ports on this machine
    assert ucx_runtime.net_devices_for("0.0.0.0") is None  # every interface: UCX's default
    with pytest.raises(ConfigError, match="no network interface"):
        ucx_runtime.net_devices_for("192.0.2.254")


class SlowDataEngine(UcxEngine):
    """Sends each frame's length at once and its block `delay_s` later: a fetch that times out
    meanwhile has a receive posted into the page."""

    delay_s = 1.0

    async def _send_frame(self, link, key, whole):
        if whole is None:
            return await super()._send_frame(link, key, whole)
        import asyncio

        data = whole.reshape(-1).view(torch.uint8).cpu().numpy()
        mac = link.next_mac(key, data.size)
        await link.endpoint.send(np.array([data.size], dtype=np.uint64))
        await asyncio.sleep(self.delay_s)
        await link.endpoint.send(data)
        if mac is not None:
            mac.update(memoryview(data))
            await link.endpoint.send(np.frombuffer(bytearray(mac.finalize()), dtype=np.uint8))


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "secret"])
def test_a_timed_out_fetch_leaves_no_receive_that_can_land_in_its_pages(monkeypatch, secret):
    batches = []

    class RecordedBatch(ucx._Batch):
        def __post_init__(self):
            super().__post_init__()
            batches.append(self)

    monkeypatch.setattr(ucx, "_Batch", RecordedBatch)
    holder, reader = new_store(1 << 20, 4), new_store(1 << 20, 4)
    server = SlowDataEngine(**LOOPBACK, cluster_secret=secret)
    client = UcxEngine(**LOOPBACK, cluster_secret=secret)
    try:
        pair = Pair(holder, reader, server, client)
        keys = pair.put(range(2))
        warm = torch.zeros(1 << 20, dtype=torch.uint8)  # dial (and handshake) first
        server.delay_s = 0.0
        assert client.fetch(pair.address, TENANT, keys[:1], [warm], 10.0) == [1 << 20]
        server.delay_s = 1.0
        page = torch.zeros(1 << 20, dtype=torch.uint8)

        received = client.fetch(pair.address, TENANT, keys[1:], [page], 0.3)
        page.fill_(0x55)  # the caller frees the page: it is someone else's now
        time.sleep(1.5)  # the block is sent meanwhile

        assert received == [0]
        assert batches[-1].receives  # a receive into the page had been posted...
        assert all(request.completed for request in batches[-1].receives)  # ...and is dead
        assert int((page != 0x55).sum()) == 0
    finally:
        server.close()
        client.close()
        holder.close()
        reader.close()


@pytest.mark.parametrize(
    "secret", [None, b"not-the-cluster-secret-at-all-00"], ids=["none", "wrong"]
)
def test_a_peer_without_the_secret_gets_nothing_for_present_or_absent_keys(make_ucx_pair, secret):
    pair = make_ucx_pair(cluster_secret=SECRET, handshake_timeout_s=0.5)
    pair.put([0])
    intruder = UcxEngine(**LOOPBACK, cluster_secret=secret, handshake_timeout_s=0.5)
    try:
        outcomes = []
        for key in KEYS[:2]:  # present, absent
            page = pair.reader.reserve_page(key)
            page.zero_()
            try:
                outcomes.append(intruder.fetch(pair.address, TENANT, [key], [page], 1.5))
            except TransferError:
                outcomes.append("refused")
            assert int(page.count_nonzero()) == 0
            pair.reader.abort(key)
    finally:
        intruder.close()

    assert outcomes[0] == outcomes[1] and outcomes[0] in ("refused", [0])
    deadline = time.monotonic() + 3.0
    while pair.server.stats.handshakes_failed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.server.stats.handshakes_failed == 2
    assert pair.server.stats.batches_served == 0


# A holder in its own process whose engine sends each frame's length at once and its block
# DELAY_S later; it prints its address and waits to be killed.
SLOW_HOLDER_SCRIPT = """
import asyncio, time
import numpy as np, torch
from kvstore.block import HEADER_BYTES
from kvstore.transfer.ucx import UcxEngine
from tests.transfer.conftest import KEYS, new_store, payload

class SlowData(UcxEngine):
    async def _send_frame(self, link, key, whole):
        if whole is None:
            return await super()._send_frame(link, key, whole)
        data = whole.reshape(-1).view(torch.uint8).cpu().numpy()
        link.next_mac(key, data.size)
        await link.endpoint.send(np.array([data.size], dtype=np.uint64))
        await asyncio.sleep(1.0)
        await link.endpoint.send(data)

store = new_store(1 << 20, 2)
store.put(KEYS[0], None, payload(0, (1 << 20) - HEADER_BYTES))
print(SlowData(tls="tcp", net_devices="lo").serve(store.open_tenant_block), flush=True)
time.sleep(120)
"""


def test_a_fetch_whose_loop_is_wedged_returns_only_once_no_receive_can_land(monkeypatch):
    """The fetching thread gives up on a wedged event loop, but UCX's progress thread still
    completes receives: fetch must not return while one is posted into a page."""
    monkeypatch.setattr(ucx, "_GRACE_S", 0.2)
    holder = subprocess.Popen(
        [sys.executable, "-c", SLOW_HOLDER_SCRIPT],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    client = UcxEngine(**LOOPBACK)
    try:
        address = holder.stdout.readline().strip()
        page = torch.zeros(1 << 20, dtype=torch.uint8)
        assert client.fetch(address, TENANT, KEYS[1:2], [page], 10.0) == [0]  # dial first
        runtime = client._runtime()
        wedge = threading.Timer(0.1, runtime.loop.call_soon_threadsafe, (time.sleep, 2.0))
        wedge.start()  # the loop stalls once the length arrived and the page receive is posted

        received = client.fetch(address, TENANT, KEYS[:1], [page], 0.3)
        page.fill_(0x55)  # the caller frees the page
        time.sleep(2.5)

        assert received == [0]
        assert int((page != 0x55).sum()) == 0  # nothing landed after fetch returned
    finally:
        holder.kill()
        holder.wait()
        for arena in SHM_DIR.glob(f"{ARENA_PREFIX}{holder.pid}-*"):
            arena.unlink(missing_ok=True)
        client.close()


# A holder that is sent UCX worker addresses of other versions, then garbage of its own
# version, by a peer it cannot authenticate (no cluster secret), in its own process: UCX
# asserts on an address version it does not know, which aborts the whole agent.
FOREIGN_ADDRESS_SCRIPT = """
import contextlib, os, random, socket, struct
from kvstore.transfer.ucx import UcxEngine
@contextlib.contextmanager
def nothing(key, tenant):
    yield None
engine = UcxEngine(tls="tcp", net_devices="lo")
port = int(engine.serve(nothing, "127.0.0.1", 0).rsplit(":", 1)[1])
own = engine._runtime().address
rng = random.Random(7)
addresses = [bytes([own[0] ^ flip]) + own[1:] for flip in (0x01, 0x0F)]
addresses += [bytes([own[0]]) + os.urandom(rng.randint(1, 300)) for _ in range(20)]
for address in addresses:
    with socket.create_connection(("127.0.0.1", port)) as peer:
        peer.sendall(struct.pack("<QI", 1234, len(address)) + address)
        peer.settimeout(3)
        with contextlib.suppress(OSError):
            peer.recv(1 << 16)
print("SURVIVED", flush=True)
engine.close()
"""


def test_a_foreign_ucx_address_is_refused_and_the_holder_lives():
    """A hello carrying a UCX address of another version (another UCX release, or any
    process reaching a port without a cluster secret) aborted the agent inside UCX
    (address.c: Assertion `*addr_version == UCP_OBJECT_VERSION_V2'); it is refused now,
    before UCX parses it, and random addresses of the right version are refused by UCX."""
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONPATH": REPO_ROOT}
    done = subprocess.run(
        [sys.executable, "-c", FOREIGN_ADDRESS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0 and "SURVIVED" in done.stdout, done.stderr[-2000:]
    assert "this UCX packs version" in done.stderr
