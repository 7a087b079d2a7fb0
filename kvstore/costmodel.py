"""Load or recompute: the predicted time to load a prompt's cached chunks from their tiers
against the time to compute them, for any engine (the vLLM connector, SGLang, `kvstore plan`).
Pure arithmetic plus small measured-rate estimators; no I/O, no locks (one caller thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError


@dataclass(frozen=True)
class PrefillRate:
    """Prefill time of `new` tokens after `cached` ones: a fixed cost, a per-token term and
    attention's quadratic term (each new token attends to every token before it)."""

    per_token_s: float
    per_token_pair_s: float = 0.0
    fixed_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token_s", "per_token_pair_s", "fixed_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"PrefillRate.{name} must be >= 0, got {getattr(self, name)}")

    def compute_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        pairs = new_tokens * (cached_tokens + (new_tokens + 1) / 2)
        return self.fixed_s + new_tokens * self.per_token_s + pairs * self.per_token_pair_s


@dataclass(frozen=True)
class TierLink:
    """How fast one tier's chunks reach the engine: seconds per byte, plus a latency paid once
    per load that touches the tier."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ConfigError(
                f"TierLink needs bandwidth > 0 and latency >= 0, got {self.bandwidth_bytes_per_s} "
                f"B/s and {self.latency_s} s"
            )

    def load_s(self, num_bytes: int) -> float:
        return num_bytes / self.bandwidth_bytes_per_s


def predicted_ttft_s(load_s: float, compute_s: float, overlap: bool) -> float:
    """Layer-by-layer loads overlap compute (max); without overlap they add up."""
    return max(load_s, compute_s) if overlap else load_s + compute_s


def best_load_prefix(
    chunk_tiers: Sequence[str], chunk_tokens: Sequence[int], chunk_bytes: int,
    prompt_tokens: int, rate: PrefillRate, links: dict[str, TierLink], overlap: bool = False,
) -> tuple[int, float]:  # fmt: skip
    """How many leading cached chunks to load so the predicted TTFT is least, and that TTFT.

    Chunk i lives in tier `chunk_tiers[i]`; the rest of the prompt is computed after it. A chunk
    whose load is predicted slower than computing it is computed (with everything after it:
    engines take one loaded prefix). Ties load (it saves GPU time).
    """
    best, best_s = 0, rate.compute_s(prompt_tokens, 0)
    load_s, cached, touched = 0.0, 0, set()
    for index, (tier, tokens) in enumerate(zip(chunk_tiers, chunk_tokens, strict=True)):
        link = links[tier]
        if tier not in touched:
            touched.add(tier)
            load_s += link.latency_s
        load_s += link.load_s(chunk_bytes)
        cached += tokens
        ttft_s = predicted_ttft_s(load_s, rate.compute_s(prompt_tokens - cached, cached), overlap)
        if ttft_s <= best_s:
            best, best_s = index + 1, ttft_s
    return best, best_s


class RateMeter:
    """A measured rate (bytes or tokens per second) as an exponentially weighted mean of
    observations, with a prior until the first one."""

    def __init__(self, prior_per_s: float, weight: float = 0.3) -> None:
        if prior_per_s <= 0 or not 0 < weight <= 1:
            raise ConfigError(f"RateMeter needs prior > 0 and weight in (0, 1], got {prior_per_s}")
        self.per_s = prior_per_s
        self.weight = weight
        self.observations = 0

    def observe(self, amount: float, seconds: float) -> None:
        """One measurement; non-positive amounts or durations are ignored."""
        if amount <= 0 or seconds <= 0:
            return
        self.per_s += self.weight * (amount / seconds - self.per_s)
        self.observations += 1
