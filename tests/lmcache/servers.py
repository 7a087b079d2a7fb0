"""The processes of the LMCache-through-kvstore scenario, each logging to its own file: a
metadata service and node agents (`python -m kvstore`), LMCache's multiprocess cache server
with the kvstore L2 adapter (`lmcache server`), and vLLM's OpenAI server with LMCache's
`LMCacheMPConnector`. Runs in the test process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvstore.bench.peers import free_port
from tests.lmcache.adapters import adapter_spec
from tests.node.agents import cluster_secret_file

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONPATH": str(ROOT),  # lmcache server imports kvstore.connectors.lmcache.adapter
}
CHUNK_TOKENS = 256
BLOCK_SIZE = 128
KV_CACHE_BYTES = 256 << 20


class Child:
    """One child process in a session of its own, its stdout and stderr in `log_path`."""

    def __init__(self, name: str, command: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **ENV},
                cwd=ROOT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, ready: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not start:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def logged_line(self, text: str) -> str:
        """The first line of its log holding `text`, once there."""
        self.wait_for(lambda: text in self.log())
        return next(line for line in self.log().splitlines() if text in line)

    def stop(self) -> None:
        """SIGTERM to its process group (vLLM's engine core is a child), then SIGKILL."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@contextmanager
def child(name: str, command: list[str], log_path: Path) -> Iterator[Child]:
    process = Child(name, command, log_path)
    try:
        yield process
    finally:
        process.stop()


@contextmanager
def kvstore_cluster(tmp_path: Path, nodes: int = 2) -> Iterator[list[Path]]:
    """A metadata service and `nodes` node agents on tcp; yields their sockets."""
    kvstore = [sys.executable, "-m", "kvstore"]
    with ExitStack() as stack:
        metadata = stack.enter_context(
            child("metadata", [*kvstore, "metadata", *_METADATA_FLAGS], tmp_path / "meta.log")
        )
        address = metadata.logged_line("listening on").split("listening on ")[1].split(",")[0]
        sockets = []
        for index in range(1, nodes + 1):
            socket_path = tmp_path / f"node-{index}.sock"
            flags = _node_flags(tmp_path, f"node-{index}", socket_path, address)
            node = stack.enter_context(
                child(f"node-{index}", [*kvstore, "node", *flags], tmp_path / f"node-{index}.log")
            )
            node.logged_line("serving workers on")
            sockets.append(socket_path)
        yield sockets


_METADATA_FLAGS = ["--backend", "memory", "--listen", "127.0.0.1:0"]


def _node_flags(tmp_path: Path, name: str, socket_path: Path, metadata: str) -> list[str]:
    return [
        *("--node-id", name, "--socket-path", str(socket_path)),
        *("--host-capacity-bytes", "64MiB", "--page-size-bytes", "1MiB"),
        *("--metadata-address", metadata, "--transfer", "tcp"),
        *("--cluster-secret-file", str(cluster_secret_file(tmp_path))),
    ]


class LMCacheServer:
    """A running `lmcache server`: its request port, HTTP API and log."""

    def __init__(self, process: Child, port: int, http_url: str) -> None:
        self.process = process
        self.port = port
        self.http_url = http_url

    def adapter_status(self) -> dict:
        """The kvstore adapter's `report_status`, as LMCache's own /status reports it."""
        with urllib.request.urlopen(f"{self.http_url}/status", timeout=10) as response:
            (status,) = json.loads(response.read())["storage_manager"]["l2_adapters"]
        return status


@contextmanager
def lmcache_server(tmp_path: Path, name: str, agent_socket: Path) -> Iterator[LMCacheServer]:
    """`lmcache server` (engine-driven transfers) with the kvstore L2 adapter."""
    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--http-port", str(http_port)]
    command += ["--chunk-size", str(CHUNK_TOKENS), "--supported-transfer-mode", "engine_driven"]
    command += ["--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--disable-observability"]
    command += ["--l2-adapter", adapter_spec(agent_socket)]
    http_url = f"http://127.0.0.1:{http_port}"
    with child(name, command, tmp_path / f"{name}.log") as process:
        process.wait_for(lambda: _http_ok(f"{http_url}/healthcheck"))
        yield LMCacheServer(process, port, http_url)


@contextmanager
def vllm_server(tmp_path: Path, name: str, model: Path, lmcache_port: int) -> Iterator[str]:
    """vLLM's OpenAI server with LMCache's multiprocess connector; its base URL."""
    port = free_port()
    transfer = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--enforce-eager"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    command += ["--kv-transfer-config", json.dumps(transfer)]
    base_url = f"http://127.0.0.1:{port}"
    with child(name, command, tmp_path / f"{name}.log") as server:
        server.wait_for(lambda: _http_ok(f"{base_url}/health"), timeout_s=600)
        yield base_url


def complete(
    base_url: str, model: Path, prompt: list[int], max_tokens: int, cache_salt: str = ""
) -> list[int]:
    """Greedy completion of token ids; the generated token ids. A `cache_salt` keeps the
    request apart from every cached prefix of other salts, in vLLM and in LMCache."""
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **({"cache_salt": cache_salt} if cache_salt else {}),
    }
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def prompt_tokens_by_source(base_url: str) -> dict[str, float]:
    """vLLM's prompt tokens by source: external_kv_transfer, local_cache_hit, local_compute."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            counts[source] = counts.get(source, 0.0) + float(line.rpartition(" ")[2])
    return counts


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
