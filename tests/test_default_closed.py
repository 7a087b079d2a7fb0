"""The embedded default is closed to other local users, narrated: `kvstore serve --data-dir D`
as the README runs it, a worker of its owner stores blocks, and a process of another uid
(`nobody`) that knows their keys tries every door: the transfer port (as a peer without the
cluster secret, with a guessed one, and with a bare request), the metadata service (no token
and a guessed one: Snapshot, Lookup, Stats), the control socket and the data dir. It gets
nothing from any of them. And the standalone services refuse to run open unless told to."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import MetadataClient
from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import start_node_process

NOBODY = 65534
TENANT = "default"
FILL = 0xA5  # every payload byte of the owner's blocks
PAYLOAD_BYTES = 4096

_ANOTHER_USER = """
import encodings.idna, json, os, socket, sys
import torch
from kvstore.client import KVStoreClient
from kvstore.errors import TransferError
from kvstore.metadata.client import MetadataClient
from kvstore.transfer.tcp import TcpEngine
from kvstore.transfer.tcp_wire import pack_request

metadata, transfer, data_dir, tenant = sys.argv[1:5]
keys = [bytes.fromhex(k) for k in sys.argv[5].split(",")]
payload = bytes([int(sys.argv[6])]) * 64
nobody = int(sys.argv[7])
os.setgroups([]); os.setgid(nobody); os.setuid(nobody)  # code loaded: become another user
out = {"uid": os.getuid(), "gid": os.getgid()}


def attempt(name, call):
    try:
        out[name] = call()
    except Exception as exc:
        out[name] = type(exc).__name__


def blocks_from(call):
    \"\"\"What a transfer gave: "nothing" (refused, broken, or every block absent), else it.\"\"\"
    try:
        got = call()
    except (TransferError, OSError):
        return "nothing"
    return got or "nothing"


def fetch(secret):
    pages = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in keys]
    engine = TcpEngine(**({"cluster_secret": secret} if secret else {}))
    try:
        received = engine.fetch(transfer, tenant, keys, pages, 3.0)
    finally:
        engine.close()
    leaked = any(payload in page.numpy().tobytes() for page in pages)
    return [n for n in received if n] + (["payload"] if leaked else [])


def bare_request():
    host, port = transfer.rsplit(":", 1)
    got = b""
    with socket.create_connection((host, int(port)), timeout=3.0) as sock:
        sock.sendall(pack_request(tenant, keys))
        try:
            while data := sock.recv(1 << 16):
                got += data
        except OSError:
            pass
    return ["payload"] if payload in got else []


def ask_metadata(token, name):
    with MetadataClient(metadata, token=token, timeout_s=3.0) as client:
        attempt(f"snapshot_{name}", lambda: [
            k.hex() for page in client.snapshot() for k in page.keys])
        attempt(f"lookup_{name}", lambda: client.lookup(tenant, keys).prefix_length)
        attempt(f"stats_{name}", lambda: str(client.stats()))


attempt("transfer_without_secret", lambda: blocks_from(lambda: fetch(None)))
attempt("transfer_guessed_secret", lambda: blocks_from(
    lambda: fetch(b"a-guessed-cluster-secret-0123456789")))
attempt("transfer_bare_request", lambda: blocks_from(bare_request))
ask_metadata(None, "without_token")
ask_metadata("a-guessed-token-0123456789abcdefghijklmnopq", "guessed_token")
control = os.path.join(data_dir, "agent.sock")
attempt("control_client", lambda: KVStoreClient(control).lookup(tenant, keys).total)
attempt("control_socket", lambda: socket.socket(socket.AF_UNIX).connect(control))
attempt("data_dir", lambda: os.listdir(data_dir))
attempt("cluster_secret", lambda: open(os.path.join(data_dir, "cluster.secret")).read())
print(json.dumps(out))
"""


@pytest.fixture
def reachable_dir():
    """A directory other users may enter (pytest's own tmp dirs are root's alone), so only
    kvstore's own modes keep `nobody` out of what serve makes in it."""
    directory = Path(tempfile.mkdtemp(prefix="kvstore-closed-"))
    os.chmod(directory, 0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def stop(process: subprocess.Popen) -> str:
    """SIGTERM, wait, and return what the process wrote on stderr."""
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    return stderr


def kvstore(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvstore", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def as_nobody(*args: str) -> dict:
    """Runs _ANOTHER_USER, which loads its code as root (the interpreter may live where
    `nobody` cannot read) and then becomes `nobody` before it touches anything of serve's."""
    attacker = subprocess.run(
        [sys.executable, "-c", _ANOTHER_USER, *args, str(NOBODY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert attacker.returncode == 0, attacker.stderr
    return json.loads(attacker.stdout)


def test_another_local_user_gets_nothing_from_a_default_serve(reachable_dir):
    data_dir = reachable_dir / "kvstore-data"
    small = ("--host-capacity-bytes", "8MiB", "--page-size-bytes", "1MiB", "--node-id", "owner")
    readme = ("serve", "--data-dir", str(data_dir))  # the README's command, on a free port
    process, address = start_cli(*readme, "--listen", "127.0.0.1:0", *small)
    try:
        agent_line = process.stdout.readline()
        transfer = agent_line.split("transfer tcp ", 1)[1].split(";", 1)[0]
        keys = chunk_keys(Namespace("m", "layout"), range(768), 256)
        with KVStoreClient(data_dir / "agent.sock", "owner") as owner:
            reservation = owner.save(TENANT, keys, PAYLOAD_BYTES)
            for view in reservation.payloads:
                view.fill_(FILL)
            assert owner.commit(reservation) == 3
        operator = (data_dir / "operator.token").read_text().strip()
        with MetadataClient(address, token=operator) as metadata:
            assert wait_until(lambda: metadata.lookup(TENANT, keys).prefix_length == 3)
        hex_keys = ",".join(bytes(key).hex() for key in keys)
        seen = as_nobody(address, transfer, str(data_dir), TENANT, hex_keys, str(FILL))
    finally:
        stop(process)
    assert (seen.pop("uid"), seen.pop("gid")) == (NOBODY, NOBODY)
    assert seen == {
        "transfer_without_secret": "nothing",
        "transfer_guessed_secret": "nothing",
        "transfer_bare_request": "nothing",
        "snapshot_without_token": "AuthError",
        "lookup_without_token": "AuthError",
        "stats_without_token": "AuthError",
        "snapshot_guessed_token": "AuthError",
        "lookup_guessed_token": "AuthError",
        "stats_guessed_token": "AuthError",
        "control_client": "UnavailableError",  # the client's name for a connect refused
        "control_socket": "PermissionError",
        "data_dir": "PermissionError",
        "cluster_secret": "PermissionError",
    }


def test_a_node_with_a_transfer_engine_and_no_cluster_secret_refuses_to_start(tmp_path):
    result = kvstore("node", "--socket-path", str(tmp_path / "a.sock"), "--transfer", "tcp")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "without a cluster secret the tcp transfer engine serves every block" in result.stderr
    assert "give --cluster-secret-file" in result.stderr
    assert "--insecure-transfer to serve them anyway" in result.stderr


def test_an_insecure_transfer_node_starts_and_says_so(tmp_path):
    process, _ = start_node_process(tmp_path, "open", "--transfer", "tcp", "--insecure-transfer")
    assert "insecure transfer: the tcp transfer engine on 127.0.0.1:" in stop(process)


def test_a_metadata_service_beyond_loopback_without_tokens_refuses_to_start(tmp_path):
    for listen in (["--listen", "0.0.0.0:0"], ["--lookup-listen", "0.0.0.0:0"]):
        result = kvstore("metadata", "--backend", "memory", *listen)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "beyond loopback without tokens" in result.stderr
        assert "give --token-file, listen on 127.0.0.1, or --insecure-no-auth" in result.stderr


@pytest.mark.parametrize(
    "flags",
    [["--listen", "0.0.0.0:0", "--insecure-no-auth"], ["--listen", "127.0.0.1:0"]],
    ids=["beyond-loopback-insecure", "loopback"],
)
def test_a_metadata_service_without_tokens_starts_where_allowed_and_warns(flags):
    process, _ = start_cli("metadata", "--backend", "memory", "--lookup-listen", "off", *flags)
    stderr = stop(process)
    assert "metadata service auth is off (no --token-file)" in stderr
    assert ("(--insecure-no-auth)" in stderr) == ("--insecure-no-auth" in flags)
