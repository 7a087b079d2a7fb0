"""One OpenAI server of `kvstore bench serve` (vLLM's api_server, with a mode's connector):
its start, warm-up and prefix-cache reset, and one run of vLLM's serving benchmark against it,
read as figures: TTFT and throughput from the client, tokens loaded, found in its own prefix
cache and computed from the server's counters. Runs in the benchmark process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvstore.bench.serve_modes import Backing
from kvstore.bench.serve_procs import (
    Child,
    counter,
    free_port,
    has_metric,
    http_ok,
    post_json,
    run_client,
    scrape,
)

if TYPE_CHECKING:
    from kvstore.bench.serve import ServeSpec

API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
VOCAB_SIZE = 512  # the bench's tiny Llama's (tiny_llama.py)
KV_CACHE_BYTES = 2 << 30  # vLLM's own, per server: 64k tokens (the default claims 92 % of RAM)
KVSTORE_COUNTERS = (
    "hit_tokens",
    "loaded_blocks",
    "helper_loaded_blocks",
    "load_failures",
    "recomputed_chunks",
    "lookup_failures",
    "saved_blocks",
)
KVSTORE_LATENCIES = ("lookup", "match", "load_fetch", "load_wait", "save")


class Server:
    """One OpenAI server (vLLM's api_server) with a mode's connector, ready and warmed up."""

    def __init__(self, child: Child, base_url: str, model: Path, spec: ServeSpec) -> None:
        self.child = child
        self.base_url = base_url
        self.model = model
        self.spec = spec
        self.runs = 0  # benchmark runs so far (names their logs)

    @classmethod
    def start(
        cls, name: str, model: Path, backing: Backing, log_dir: Path, spec: ServeSpec
    ) -> Server:
        """Spawn it on a free port and wait until it answers /health."""
        port = free_port()
        command = [*API_SERVER, "--model", str(model)]
        command += f"--dtype float32 --block-size {spec.block_size} --enforce-eager".split()
        command += f"--host 127.0.0.1 --port {port}".split()
        command += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        if backing.transfer is not None:
            command += ["--kv-transfer-config", json.dumps(backing.transfer)]
        log_path = log_dir / f"{name.replace(' ', '-')}.log"
        server = cls(
            Child.spawn(name, command, log_path, backing.env),
            f"http://127.0.0.1:{port}",
            model,
            spec,
        )
        server.child.wait_ready(lambda: http_ok(f"{server.base_url}/health"))
        return server

    def warm_up(self) -> None:
        """One request of its own tokens (no benchmark prompt shares a chunk of it)."""
        rng = np.random.default_rng(10_000 + self.spec.seed)
        prompt = rng.integers(4, VOCAB_SIZE, self.spec.prompt_tokens).tolist()
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": self.spec.output_tokens,
        }
        post_json(f"{self.base_url}/v1/completions", body)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache; a connector's store keeps what it holds."""
        post_json(f"{self.base_url}/reset_prefix_cache", {})

    def bench(self, concurrency: int, seed: int, log_dir: Path) -> dict:
        """vllm.benchmarks.serve at `concurrency` over the prompts of `seed`; its figures."""
        before = scrape(self.base_url)
        self.runs += 1
        tag = f"{self.child.name.replace(' ', '-')}-{self.runs}-c{concurrency}"
        result = run_client(
            self._client_args(concurrency, seed),
            log_dir / f"{tag}-client.log",
            log_dir / f"{tag}.json",
        )
        return _figures(result, before, scrape(self.base_url))

    def _client_args(self, concurrency: int, seed: int) -> list[str]:
        """vllm.benchmarks.serve's flags; it skips its ready check (this server is ready)."""
        spec, model = self.spec, str(self.model)
        workload = (
            f"--dataset-name prefix_repetition --prefix-repetition-prefix-len {spec.prefix_tokens}"
            f" --prefix-repetition-suffix-len {spec.suffix_tokens}"
            f" --prefix-repetition-num-prefixes {spec.num_prefixes}"
            f" --prefix-repetition-output-len {spec.output_tokens}"
            f" --num-prompts {spec.num_prompts} --max-concurrency {concurrency} --seed {seed}"
            " --ignore-eos --temperature 0 --percentile-metrics ttft,tpot,e2el"
            " --metric-percentiles 50,90 --ready-check-timeout-sec 0 --disable-tqdm"
        )
        where = ["--backend", "vllm", "--base-url", self.base_url, "--model", model]
        return [*where, "--tokenizer", model, *workload.split()]

    def stop(self) -> None:
        self.child.stop()


def _figures(result: dict, before: dict, after: dict) -> dict:
    """TTFT percentiles and throughput from the client; from the server's own counters, the
    prompt tokens it loaded from its connector, found in its prefix cache, and computed."""

    def delta(name: str, label: str = "") -> float:
        return counter(after, name, label) - counter(before, name, label)

    requests = result["completed"]
    prompt = delta("vllm:prompt_tokens_total")
    by_source = {
        source: delta("vllm:prompt_tokens_by_source_total", f'source="{source}"')
        for source in ("external_kv_transfer", "local_cache_hit", "local_compute")
    }
    figures = {
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "ttfts_ms": [round(t * 1000, 2) for t in result["ttfts"]],
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_token_throughput": result["total_token_throughput"],
        "requests": requests,
        "failed": result["failed"],
        "prompt_tokens": prompt,
        "loaded_tokens": by_source["external_kv_transfer"],
        "local_hit_tokens": by_source["local_cache_hit"],
        "computed_tokens": by_source["local_compute"],
        "loaded_fraction": by_source["external_kv_transfer"] / prompt if prompt else 0.0,
        "computed_tokens_per_request": by_source["local_compute"] / max(requests, 1),
    }
    if has_metric(after, "vllm:kvstore_hit_tokens_total"):
        figures["kvstore"] = _kvstore_figures(delta)
    return figures


def _kvstore_figures(delta) -> dict:
    """The connector's own counters over the run, and the mean of each of its latencies (ms):
    where a hit's time goes (lookup, the scheduler's wait for it, pinning, the forward's wait
    for layer loads)."""
    figures = {name: delta(f"vllm:kvstore_{name}_total") for name in KVSTORE_COUNTERS}
    for name in KVSTORE_LATENCIES:
        count = delta(f"vllm:kvstore_{name}_seconds_count")
        total_s = delta(f"vllm:kvstore_{name}_seconds_sum")
        figures[f"{name}_count"] = count
        figures[f"{name}_mean_ms"] = total_s / count * 1000 if count else None
    return figures
