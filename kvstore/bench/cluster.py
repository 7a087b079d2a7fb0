"""A real cluster on loopback for `bench chaos` and `bench soak`: one metadata service (LMDB),
node agents over tcp and chaos workers, each a separate process, started, killed, restarted
and sampled (/proc) from here. Runs in the benchmark process; every command line is built by
`command_line`, and `stop` leaves no child process and no arena file of ours behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.bench.peers import free_port
from kvstore.errors import ConfigError, KVStoreError
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR

logger = logging.getLogger(__name__)
READY = {"metadata": "listening on", "agent": "serving workers on", "worker": ""}
START_TIMEOUT_S = 90.0  # torch imports on two busy cores
LineHandler = Callable[["Member", int, dict], None]


@dataclass(frozen=True)
class ClusterSpec:
    workdir: Path
    duration_s: float  # how long workers run unless stopped sooner
    seed: int = 0
    agents: int = 3
    workers_per_agent: int = 1
    host_capacity_bytes: int = 32 << 20
    page_size_bytes: int = 1 << 20
    disk_capacity_bytes: int = 256 << 20  # more than the whole key space: the disk never drops
    ops_per_s: float = 20.0  # per worker
    slide_s: float = 0.0  # workers' prefix window moves every slide_s seconds (0: fixed)
    corrupt_worker: str = ""  # test only: this worker flips a byte of one expected payload

    def __post_init__(self) -> None:
        if self.agents < 1 or self.workers_per_agent < 1:
            raise ConfigError("a cluster needs at least one agent and one worker per agent")


@dataclass
class Member:
    """One process slot: restarts replace `process` and bump `incarnation`."""

    name: str
    role: str  # metadata | agent | worker
    agent: str = ""  # a worker's agent
    process: subprocess.Popen | None = None
    incarnation: int = 0
    started_at: float = 0.0
    pids: list[int] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)


class Cluster:
    def __init__(self, spec: ClusterSpec, on_line: LineHandler | None = None) -> None:
        self.spec = spec
        self.on_line = on_line or (lambda *_: None)
        self.metadata_address = f"127.0.0.1:{free_port()}"
        # its own, not "auto" (the gRPC port + 1, which another process may hold), kept
        # across the service's restarts
        self.lookup_address = f"127.0.0.1:{free_port()}"
        self.members: dict[str, Member] = {"metadata": Member("metadata", "metadata")}
        for a in range(1, spec.agents + 1):
            self.members[f"agent-{a}"] = Member(f"agent-{a}", "agent")
        for a in range(1, spec.agents + 1):
            for w in range(1, spec.workers_per_agent + 1):
                name = f"worker-{a}.{w}"
                self.members[name] = Member(name, "worker", agent=f"agent-{a}")
        self.started = time.monotonic()
        self._previous_sigterm = None

    # ---- paths and command lines -----------------------------------------------------------
    def socket_path(self, agent: str) -> Path:
        return self.spec.workdir / f"{agent}.sock"

    def command_line(self, member: Member) -> list[str]:
        """The one place every child's command line is built (add cluster-wide flags here)."""
        spec, base = self.spec, [sys.executable, "-m"]
        if member.role == "metadata":
            return [
                *base,
                "kvstore",
                "metadata",
                "--backend",
                "lmdb",
                "--listen",
                self.metadata_address,
                "--lookup-listen",
                self.lookup_address,
                "--data-dir",
                str(spec.workdir / "metadata"),
            ]
        if member.role == "agent":
            return [
                *base,
                "kvstore",
                "node",
                "--node-id",
                member.name,
                "--socket-path",
                str(self.socket_path(member.name)),
                "--host-capacity-bytes",
                str(spec.host_capacity_bytes),
                "--page-size-bytes",
                str(spec.page_size_bytes),
                "--disk-dir",
                str(spec.workdir / f"{member.name}-disk"),
                "--disk-capacity-bytes",
                str(spec.disk_capacity_bytes),
                "--metadata-address",
                self.metadata_address,
                "--transfer",
                "tcp",
                "--transfer-host",
                "127.0.0.1",
                "--cluster-secret-file",
                str(self.secret_path),
            ]
        remaining_s = max(1.0, spec.duration_s - (time.monotonic() - self.started))
        corrupt = ["--corrupt-expected"] if member.name == spec.corrupt_worker else []
        return [
            *base,
            "kvstore.bench.chaos_worker",
            "--name",
            member.name,
            "--socket",
            str(self.socket_path(member.agent)),
            "--seed",
            str(spec.seed),
            "--duration-s",
            f"{remaining_s:.1f}",
            "--ops-per-s",
            str(spec.ops_per_s),
            "--slide-s",
            str(spec.slide_s),
            *corrupt,
        ]

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)

    def start(self) -> None:
        """Metadata service, then every agent (in parallel), then every worker."""
        self.secret_path.write_text(secrets.token_hex(32))  # transfers are authenticated
        self.secret_path.chmod(0o600)
        self.spawn("metadata")
        self.wait_ready("metadata")
        agents = self.names("agent")
        for name in agents:
            self.spawn(name)
        for name in agents:
            self.wait_ready(name)
        self.started = time.monotonic()  # the workers' run time counts from here
        for name in self.names("worker"):
            self.spawn(name)

    @property
    def secret_path(self):
        return self.spec.workdir / "cluster.secret"

    def names(self, role: str) -> list[str]:
        return [name for name, member in self.members.items() if member.role == role]

    def spawn(self, name: str) -> Member:
        member = self.members[name]
        member.ready.clear()
        member.incarnation += 1
        with (self.spec.workdir / f"{name}.log").open("ab") as log:
            member.process = subprocess.Popen(
                self.command_line(member),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=dict(os.environ),
                preexec_fn=_die_with_parent,
            )
        member.started_at = time.monotonic()
        member.pids.append(member.process.pid)
        threading.Thread(
            target=self._read,
            args=(member, member.process, member.incarnation),
            name=f"read-{name}",
            daemon=True,
        ).start()
        return member

    def _read(self, member: Member, process: subprocess.Popen, incarnation: int) -> None:
        marker = READY[member.role]
        if not marker:
            member.ready.set()
        for line in process.stdout:
            if not member.ready.is_set() and marker in line:
                member.ready.set()
            elif member.role == "worker" and line.startswith("{"):
                try:
                    self.on_line(member, incarnation, json.loads(line))
                except ValueError:
                    logger.warning("%s printed a bad line: %r", member.name, line)

    def wait_ready(self, name: str, timeout_s: float = START_TIMEOUT_S) -> None:
        member = self.members[name]
        deadline = time.monotonic() + timeout_s
        while not member.ready.wait(0.1):
            if member.process.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"{name} did not start; its log: {self.log_tail(name)}")

    def log_tail(self, name: str, size_bytes: int = 2000) -> str:
        data = (self.spec.workdir / f"{name}.log").read_bytes()
        return data[-size_bytes:].decode(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL, and reap, the current process of `name`."""
        process = self.members[name].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
        if process is not None:
            process.wait()

    def restart(self, name: str) -> Member:
        """A new process with the same command line (same socket, disk dir, port)."""
        self.kill(name)
        return self.spawn(name)

    def exited(self) -> list[str]:
        """Members whose current process is no longer running."""
        return [n for n, m in self.members.items() if m.process and m.process.poll() is not None]

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM workers, then agents, then the metadata service; SIGKILL what lingers.
        Then unlink every arena file an agent of ours created (a killed agent leaves its own)."""
        for role in ("worker", "agent", "metadata"):
            processes = [
                m.process
                for m in self.members.values()
                if m.role == role and m.process and m.process.poll() is None
            ]
            for process in processes:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for process in processes:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for member in self.members.values():
            if member.process is not None and member.process.poll() is None:
                member.process.kill()
                member.process.wait()
        remove_arenas(self.all_pids())

    def all_pids(self) -> list[int]:
        return [pid for member in self.members.values() for pid in member.pids]


@contextmanager
def work_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory for sockets, disk tiers and logs; $KVSTORE_BENCH_WORKDIR instead
    (kept afterwards) to read the children's logs."""
    kept = os.environ.get("KVSTORE_BENCH_WORKDIR")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        yield Path(kept)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        yield Path(directory)


def isolate_shm(size_bytes: int = 1 << 30) -> bool:
    """Give this thread and the children it starts a private tmpfs on /dev/shm (a new mount
    namespace; needs CAP_SYS_ADMIN). Agents remove arenas whose owner pid looks dead, and pids
    are per pid namespace: agents of other containers sharing /dev/shm would unlink ours (and
    ours theirs). Returns False, changing nothing visible, where that is not possible."""
    if threading.current_thread() is not threading.main_thread():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 1 << 18
    options = f"size={size_bytes},mode=1777".encode()
    isolated = (
        libc.unshare(clone_newns) == 0
        and libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0
        and libc.mount(b"tmpfs", str(SHM_DIR).encode(), b"tmpfs", 0, options) == 0
    )
    if not isolated:
        error = os.strerror(ctypes.get_errno())
        logger.warning("sharing /dev/shm with other namespaces: %s", error)
    return isolated


def _raise_exit(*_: object) -> None:
    raise SystemExit(143)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the benchmark process dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


# ---- probes: does a role serve again? ------------------------------------------------------
def agent_answers(socket_path: Path, probe_key: bytes) -> bool:
    """A lookup through a fresh client connection is answered."""
    from kvstore.client import KVStoreClient

    try:
        with KVStoreClient(socket_path, "chaos-probe", timeout_s=5) as client:
            client.lookup("chaos", [probe_key], local_only=True)
        return True
    except (KVStoreError, OSError):
        return False


def metadata_answers(address: str) -> bool:
    from kvstore.metadata.client import MetadataClient

    try:
        with MetadataClient(address, timeout_s=2) as client:
            client.stats()
        return True
    except KVStoreError:
        return False


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


# ---- resources -----------------------------------------------------------------------------
def arena_files(pids: list[int]) -> list[Path]:
    """Arena files in /dev/shm owned (by name) by one of `pids`."""
    return [path for pid in pids for path in SHM_DIR.glob(f"{ARENA_PREFIX}{pid}-*")]


def remove_arenas(pids: list[int]) -> None:
    for path in arena_files(pids):
        path.unlink(missing_ok=True)


def process_sample(pid: int) -> dict[str, float] | None:
    """RSS and its private part (MiB), threads and open file descriptors of a live process;
    None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

    def mib(name: str) -> float:
        return int(fields.get(name, "0 kB").split()[0]) / 1024

    return {
        "rss_mib": mib("VmRSS"),
        "rss_anon_mib": mib("RssAnon"),
        "threads": int(fields["Threads"]),
        "fds": fds,
    }


def shm_sample(pids: list[int]) -> dict[str, float]:
    """Bytes in /dev/shm: of our arenas (allocated, not apparent) and of the whole mount."""
    ours = 0
    for path in arena_files(pids):
        with contextlib.suppress(FileNotFoundError):  # its agent stopped meanwhile
            ours += path.stat().st_blocks * 512
    used = os.statvfs(SHM_DIR)
    total_used = (used.f_blocks - used.f_bfree) * used.f_frsize
    return {"arena_mib": ours / (1 << 20), "shm_used_mib": total_used / (1 << 20)}
