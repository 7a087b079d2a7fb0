"""The planner's inputs, validated once: candidate tier sizes, bandwidths, GPU prefill rate and
prices, with documented defaults. Runs in the `kvstore plan` process (the CLI edge).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import parse_size
from kvstore.costmodel import PrefillRate
from kvstore.errors import ConfigError
from kvstore.plan.model import ModelSpec

GIB = 1 << 30

# Defaults and where they come from (override any of them with --prices / --bandwidths).
DEFAULT_PRICES = {
    # Lambda Cloud on-demand list price of one H100 SXM GPU (8-GPU instance), 2024-2025.
    "gpu_hour": 2.99,
    # Marginal DRAM price on AWS us-east-1 on-demand: r7i.xlarge (32 GiB, $0.2646/h) minus
    # m7i.xlarge (16 GiB, $0.2016/h), same 4 vCPUs: $0.063/h for 16 GiB = $2.87 per GiB-month.
    "dram_gb_month": 2.87,
    # AWS EBS gp3 list price, us-east-1: $0.08 per GB-month (local NVMe costs less to own).
    "nvme_gb_month": 0.08,
}
DEFAULT_BANDWIDTHS = {
    "host": 25e9,  # bytes/s per GPU: pinned host -> HBM over PCIe Gen5 x16, ~half its peak
    "disk": 12e9,  # bytes/s per node: two PCIe Gen4 NVMe drives at ~6 GB/s sequential read
    "remote": 50e9,  # bytes/s per node: one 400 Gb/s NIC (RDMA)
}
# NVIDIA H100 SXM datasheet: 989 dense BF16 TFLOP/s; 0.5 of it is typical of long prefills.
DEFAULT_GPU_TFLOPS = 989.0
DEFAULT_MFU = 0.5
HOURS_PER_MONTH = 730.0
MINUTES = 60.0


@dataclass(frozen=True)
class Prices:
    gpu_hour: float
    dram_gb_month: float
    nvme_gb_month: float

    def storage_usd_per_s(self, dram_bytes: int, nvme_bytes: int) -> float:
        monthly = dram_bytes / 1e9 * self.dram_gb_month + nvme_bytes / 1e9 * self.nvme_gb_month
        return monthly / (HOURS_PER_MONTH * 3600.0)


@dataclass(frozen=True)
class PlanOptions:
    codecs: tuple[str, ...] = ("raw", "fp8")
    dram_bytes: tuple[int, ...] = tuple(s * GIB for s in (0, 128, 512, 2048))
    nvme_bytes: tuple[int, ...] = tuple(s * GIB for s in (0, 4096, 16384))
    nodes: tuple[int, ...] = (1,)
    tp_size: int = 1
    gpus_per_node: int = 8
    bandwidths: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTHS))
    prices: Prices = field(default_factory=lambda: Prices(**DEFAULT_PRICES))
    sla_ttft_s: float = 2.0
    sla_quantile: float = 0.9
    gpu_tflops: float = DEFAULT_GPU_TFLOPS
    mfu: float = DEFAULT_MFU
    prefill_fixed_s: float = 0.0
    prefill_flops_per_s: float | None = None  # measured (from a bench vllm run) beats tflops × mfu
    host_policy: str = "lru"
    disk_policy: str = "lru"
    overlap: bool = True  # loads overlap compute layer by layer (CUDA); False: serial (CPU)

    @property
    def instances_per_node(self) -> int:
        return max(1, self.gpus_per_node // self.tp_size)

    def prefill_rate(self, model: ModelSpec) -> PrefillRate:
        """One model instance (tp_size GPUs): time per token and per attention token pair."""
        flops_per_s = self.prefill_flops_per_s or self.gpu_tflops * 1e12 * self.mfu * self.tp_size
        return PrefillRate(
            per_token_s=model.linear_flops_per_token / flops_per_s,
            per_token_pair_s=model.attention_flops_per_pair / flops_per_s,
            fixed_s=self.prefill_fixed_s,
        )


def parse_tiers(text: str) -> dict[str, tuple[int, ...]]:
    """'dram=128GiB,1TiB;nvme=0,8TiB;nodes=1,4' -> sizes in bytes (nodes: counts)."""
    result: dict[str, tuple[int, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, values = part.partition("=")
        name = name.strip()
        if name not in ("dram", "nvme", "nodes") or not values:
            raise ConfigError(f"--tiers: {part!r} is not dram=SIZES, nvme=SIZES or nodes=COUNTS")
        result[name] = tuple(
            _size(v, f"--tiers {name}", name == "nodes") for v in values.split(",")
        )
    return result


def _size(text: str, where: str, count: bool) -> int:
    try:
        value = int(text) if count else parse_size(text)
    except (ValueError, KeyError):
        raise ConfigError(f"{where}: {text!r} is not a size (e.g. 512GiB)") from None
    if value < 0 or (count and value < 1):
        raise ConfigError(f"{where}: {text!r} must be {'at least 1' if count else 'non-negative'}")
    return value


def parse_pairs(text: str, known: dict[str, float], where: str) -> dict[str, float]:
    """'gpu_hour=2.5,nvme_gb_month=0.05' over the defaults `known`; positive numbers only."""
    result = dict(known)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in known:
            raise ConfigError(f"{where}: unknown {name!r}; known: {', '.join(known)}")
        try:
            result[name] = float(value)
        except ValueError:
            raise ConfigError(f"{where}: {name}={value!r} is not a number") from None
        if result[name] < 0 or (where == "--bandwidths" and result[name] == 0):
            raise ConfigError(f"{where}: {name} must be positive, got {value}")
    return result


def bandwidths_from_bench(paths: list[Path], base: dict[str, float]) -> dict[str, float]:
    """Take host (shm get), disk (disk tier read) and remote (tcp fetch) GB/s from `kvstore
    bench transfer` / `micro` JSON outputs; missing figures keep `base`."""
    result = dict(base)
    for path in paths:
        try:
            figures = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"--bandwidths-from {path}: not a bench JSON output ({exc})"
            ) from None
        for tier, prefix in (
            ("host", "shm_get_GBps"),
            ("disk", "disk_read_GBps"),
            ("remote", "tcp_get_GBps"),
        ):
            rates = [v for k, v in figures.items() if k.startswith(prefix) and v]
            if rates:
                result[tier] = max(rates) * 1e9
    return result


def prefill_flops_from_bench(path: Path) -> float:
    """Effective FLOP/s of a `kvstore bench vllm` run: its model's FLOPs for a cold prompt over
    the measured cold TTFT."""
    from kvstore.plan.model import model_from_config

    try:
        figures = json.loads(Path(path).read_text(encoding="utf-8"))
        dims, tokens, ttft_s = figures["model"], figures["prompt_tokens"], figures["ttft_cold_s"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--prefill-from {path}: not a bench vllm output ({exc})") from None
    model = model_from_config(
        {
            "num_hidden_layers": dims["num_layers"],
            "hidden_size": dims["hidden_size"],
            "num_attention_heads": dims["num_heads"],
            "num_key_value_heads": dims["num_kv_heads"],
            "head_dim": dims["head_dim"],
            "intermediate_size": 2 * dims["hidden_size"],
            "vocab_size": 512,
            "torch_dtype": "float32",
        },
        str(path),
    )
    flops = tokens * model.linear_flops_per_token
    flops += tokens * (tokens + 1) / 2 * model.attention_flops_per_pair
    return flops / ttft_s
