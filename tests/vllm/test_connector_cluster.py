"""Two "hosts" on loopback, each with its node agent, sharing through the metadata service and
the tcp transfer engine: engines as processes, and OpenAI-compatible servers over HTTP."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kvstore.client import KVStoreClient
from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import start_node_process
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine


@pytest.fixture
def two_hosts(tmp_path):
    """A metadata service and node agents host-1 and host-2 (tcp), each a process."""
    metadata, address = start_cli("metadata", "--backend", "memory", "--listen", "127.0.0.1:0")
    nodes = []
    try:
        for name in ("host-1", "host-2"):
            nodes.append(
                start_node_process(
                    tmp_path,
                    name,
                    "--metadata-address",
                    address,
                    "--transfer",
                    "tcp",
                    "--page-size-bytes",
                    str(256 << 10),
                )
            )
        yield address, [socket for _, socket in nodes]
    finally:
        for process in [node for node, _ in nodes] + [metadata]:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)


def agent_stats(socket) -> dict:
    with KVStoreClient(socket, "test") as client:
        return json.loads(client.stats())


def seen_by_view(socket, keys: int) -> bool:
    """The other agent's cluster view holds the published keys (lookups are answered from it)."""
    view = agent_stats(socket)["view"]
    return not view or (view["ready"] and view["keys"] >= keys)


def test_two_engines_on_two_hosts_share_a_prefix(tmp_path, two_hosts, baselines, tiny_llama_fp32):
    _, (socket_1, socket_2) = two_hosts
    run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A], socket_1)
    assert wait_until(lambda: agent_stats(socket_1)["published_blocks"] >= SHARED_CHUNKS, 10)
    assert wait_until(lambda: seen_by_view(socket_2, SHARED_CHUNKS), 10)
    results, stats = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_B], socket_2)
    assert results[0]["num_cached_tokens"] == SHARED_CHUNKS * CHUNK_TOKENS
    assert stats["loaded_blocks"] == SHARED_CHUNKS
    assert agent_stats(socket_2)["requests"]["load_remote"] == SHARED_CHUNKS
    assert results[0]["tokens"] == baselines["float32"][1]


def start_api_server(model, socket, port: int, log) -> subprocess.Popen:
    transfer = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": str(socket), "chunk_tokens": CHUNK_TOKENS},
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        "32",
        "--gpu-memory-utilization",
        "0.2",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(transfer),
        "--served-model-name",
        "tiny",
    ]
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(port: int, process, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the API server exited during start-up"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError("the API server did not become healthy")


def complete(port: int, prompt: list[int]) -> list[int]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def metrics(port: int, names) -> dict[str, float]:
    """The named series of the server's /metrics (engine labels dropped, others kept)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        kept = [part for part in labels.rstrip("}").split(",") if part.startswith("source=")]
        key = name + (f"{{{kept[0]}}}" if kept else "")
        if key in names:
            found[key] = found.get(key, 0) + float(value)
    return found


def test_two_openai_servers_share_a_prefix_over_http(
    tmp_path, two_hosts, baselines, tiny_llama_fp32
):
    from tests.metadata.conftest import free_port

    _, (socket_1, socket_2) = two_hosts
    ports = [free_port(), free_port()]
    with open(tmp_path / "server.log", "w") as log:
        servers = [
            start_api_server(tiny_llama_fp32, s, p, log)
            for s, p in zip((socket_1, socket_2), ports, strict=True)
        ]
        try:
            for port, server in zip(ports, servers, strict=True):
                wait_healthy(port, server)
            assert complete(ports[0], PROMPT_A) == baselines["float32"][0]
            assert wait_until(
                lambda: agent_stats(socket_1)["published_blocks"] >= SHARED_CHUNKS, 10
            )
            assert wait_until(lambda: seen_by_view(socket_2, SHARED_CHUNKS), 10)
            assert complete(ports[1], PROMPT_B) == baselines["float32"][1]
            assert agent_stats(socket_2)["requests"]["load_remote"] == SHARED_CHUNKS
            shared_tokens = SHARED_CHUNKS * CHUNK_TOKENS
            expected = {
                "vllm:kvstore_hit_tokens_total": shared_tokens,
                'vllm:prompt_tokens_cached_by_source_total{source="p2p"}': shared_tokens,
                "vllm:kvstore_loaded_blocks_total": SHARED_CHUNKS,
            }
            assert wait_until(lambda: metrics(ports[1], expected) == expected, 10), metrics(
                ports[1], expected
            )
        finally:
            for server in servers:
                server.send_signal(signal.SIGTERM)
            for server in servers:
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
