"""A real Redis Cluster on loopback: masters with a replica each, `redis-cli --cluster create`.

Started by `kvstore bench shards` and, once per session, by the tests' `redis_cluster` fixture
(tests/metadata/conftest.py), in that process; a test may SIGKILL a master and `restart` it,
after which it rejoins as a replica. Every process dies at `stop`.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

NODE_TIMEOUT_MS = 1000  # how long a silent master stays master: the failover's floor
START_TIMEOUT_S = 30.0


def _free_ports(count: int) -> list[int]:
    """Ports p with p + 10000 free too (the cluster bus), all distinct."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 55535 and port not in ports and _bindable(port + 10000):
            ports.append(port)
    return ports


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(predicate, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"redis cluster: {what} within {timeout_s} s")
        time.sleep(0.1)


class RedisClusterProcesses:
    """Six redis-server processes forming one cluster; `url` names every node (seed list)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = workdir
        self.ports = _free_ports(masters * 2)
        self.processes: dict[int, subprocess.Popen] = {}
        self.url = "redis://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self) -> None:
        for port in self.ports:
            self._spawn(port)
        for port in self.ports:
            _wait(lambda port=port: self._ping(port), f"node {port} answering")
        subprocess.run(
            [
                shutil.which("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=START_TIMEOUT_S,
        )
        self.wait_healthy()

    def _spawn(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [
                shutil.which("redis-server"),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--save",
                "",
                "--appendonly",
                "no",
                "--repl-diskless-sync-delay",
                "0",
                "--dir",
                str(node_dir),
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
        )

    @staticmethod
    def _client(port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _ping(self, port: int) -> bool:
        try:
            with self._client(port) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def _info(self, port: int) -> dict:
        try:
            with self._client(port) as client:
                return client.cluster("info")
        except redis.RedisError:
            return {}

    def _synced(self, port: int) -> bool:
        """A master, or a replica whose initial sync finished (only such a one can take over)."""
        try:
            with self._client(port) as client:
                info = client.info("replication")
        except redis.RedisError:
            return False
        return info.get("role") == "master" or info.get("master_link_status") == "up"

    def wait_healthy(self) -> None:
        """Every running node says cluster_state ok, knows 3 masters with slots, and every
        replica is in sync with its master."""

        def healthy() -> bool:
            infos = [self._info(port) for port in self.running()]
            return all(
                info.get("cluster_state") == "ok" and int(info.get("cluster_size", 0)) == 3
                for info in infos
            ) and all(self._synced(port) for port in self.running())

        _wait(healthy, "cluster_state ok on every node")

    def running(self) -> list[int]:
        return [port for port, proc in self.processes.items() if proc.poll() is None]

    def master_of(self, key: bytes) -> int:
        """The port of the master that serves `key`'s slot now."""
        for port in self.running():
            try:
                with self._client(port) as client:
                    slot = client.cluster("keyslot", key)
                    for row in client.cluster("shards"):
                        if any(start <= slot <= end for start, end in _ranges(row[b"slots"])):
                            return _master_port(row[b"nodes"])
            except redis.RedisError:
                continue
        raise AssertionError(f"no running node knows the master of {key!r}")

    def replica_of(self, master: int) -> int:
        for port in self.running():
            with self._client(port) as client:
                info = client.info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master:
                return port
        raise AssertionError(f"master {master} has no running replica")

    def pause(self, port: int) -> None:
        """SIGSTOP: the node stops reading its replication stream (a lagging replica)."""
        self.processes[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGCONT)

    def keys_on(self, port: int, pattern: bytes) -> list[bytes]:
        with self._client(port) as client:
            return list(client.scan_iter(match=pattern, count=1000))

    def kill(self, port: int) -> None:
        process = self.processes[port]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start a killed node again; it rejoins (as a replica of its promoted replica)."""
        self._spawn(port)
        _wait(lambda: self._ping(port), f"node {port} answering again")
        self.wait_healthy()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(timeout=10)


def _ranges(flat: list) -> list[tuple[int, int]]:
    return [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]


def _master_port(nodes: list[dict]) -> int:
    for node in nodes:
        if node[b"role"] == b"master" and node[b"health"] == b"online":
            return int(node[b"port"])
    raise AssertionError("a shard without an online master")
