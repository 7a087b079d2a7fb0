"""Load or recompute: the predicted time to load a prompt's cached chunks from their tiers
against the time to compute them, for any engine (the vLLM connector, SGLang, `kvstore plan`).
Pure arithmetic plus small measured-rate estimators, no I/O; runs in the caller's process
(the vLLM connector's scheduler, `kvstore plan`).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import ConfigError

LOAD_MARGIN = 2.0  # kvstore plan validate: a load refused only when predicted this much slower
FETCH_SAMPLES = 8  # reads outside steps that price a tier: the newest, so a tier's figure moves


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
    chunk_tiers: Sequence[str],
    chunk_tokens: Sequence[int],
    chunk_bytes: int,
    prompt_tokens: int,
    rate: PrefillRate,
    links: dict[str, TierLink],
    overlap: bool = False,
) -> tuple[int, float]:
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
        if ttft_s <= best_s + 1e-9:  # ties (a rate fitted flat) load
            best, best_s = index + 1, ttft_s
    return best, best_s


def fit_nonnegative(columns: dict[str, np.ndarray], seconds: np.ndarray) -> dict[str, float]:
    """Least squares of `seconds` over `columns`; a term fitted negative is dropped and the
    rest refitted, so every coefficient is >= 0 (dropped ones are 0)."""
    kept = dict(columns)
    solution = np.zeros(0)
    while kept:
        matrix = np.stack(list(kept.values()), axis=1)
        solution = np.linalg.lstsq(matrix, seconds, rcond=None)[0]
        if (solution >= 0).all():
            break
        del kept[list(kept)[int(np.argmin(solution))]]
    values = dict.fromkeys(columns, 0.0)
    values.update({name: float(value) for name, value in zip(kept, solution, strict=False)})
    return values


@dataclass(frozen=True)
class Step:
    """One engine step as the scheduler saw it: tokens computed, attention pairs, chunks loaded
    per tier, and how long it took."""

    tokens: int
    pairs: float
    chunks: dict[str, int]
    seconds: float


class OnlineLoadPlanner:
    """Load-or-recompute from measurements: the compute rate is fitted on the engine's steps
    that loaded nothing; each tier's seconds per chunk come from its reads timed outside the
    forward (`observe_fetch`: the staging of the chunks a request loads, and background
    probes of one chunk: see kvstore/connectors/vllm/probes.py) and from steps that loaded
    from it alone (their time beyond the predicted compute). A chunk is loaded only when that
    is predicted faster than computing it (`margin` times faster; ties load): no live
    request loads from a tier to find out how fast it is.

    A tier never measured yet cannot be priced: its chunks are computed (with everything
    after them: engines take one loaded prefix) until a probe times it (the vLLM connector
    probes the tiers of the chunks it computes, off the request's path, and never holds a
    request for a probe). Computing is the choice whose regret is
    bounded: the requests that find a tier before its first probe ends compute a prefix they
    could have loaded, while loading from a tier that turns out slow (a throttled link, a
    failing disk) can cost many times the compute. Until the engine has timed its own compute
    (`min_compute_steps` plain steps) nothing can be priced, and every cached chunk is loaded,
    as without this rule.

    Loads made outside a step (disk chunks promoted to host, other hosts' chunks pulled,
    before the request is scheduled) cost their own tier's time plus the step's load from
    `loaded_from`. Tier names are the caller's (the vLLM connector: host, disk, remote).
    `free_tiers` are always loaded and cost nothing on top of another tier's fetch: the vLLM
    connector's host arena, which the forward copies in place at memory speed (a chunk in a
    fraction of a millisecond, against milliseconds to compute it), and whose per-step residual
    is mostly compute noise on a busy machine (it made hits into recomputes).
    Thread-safe: the scheduler observes steps while its lookup and probe threads decide and
    observe reads."""

    def __init__(
        self,
        chunk_tokens: int,
        window: int = 256,
        min_compute_steps: int = 3,
        margin: float = 1.0,
        free_tiers: frozenset[str] = frozenset(),
        fetch_samples: int = FETCH_SAMPLES,
    ) -> None:
        self.chunk_tokens = chunk_tokens
        self.free_tiers = free_tiers  # always loaded: read in place at copy speed (see below)
        self.margin = margin  # load only chunks predicted `margin` times faster than compute
        self.steps: deque[Step] = deque(maxlen=window)
        self.min_compute_steps = min_compute_steps
        self.fetch_samples = fetch_samples
        self._loads: dict[str, dict[str, int]] = {}  # request -> chunks per tier, until scheduled
        self._running: tuple[float, int, float, dict[str, int]] | None = None
        self.recomputed_chunks = 0
        self.decisions = 0
        self._fetched: dict[str, deque[float]] = {}  # tier -> seconds per chunk, outside steps
        self._lock = threading.Lock()

    # ---- decisions -----------------------------------------------------------------------
    def chunks_to_load(
        self, request_id: str, tiers: list[str], prompt_tokens: int, loaded_from: str = ""
    ) -> int:
        """How many of the leading cached chunks (`tiers[i]`: where chunk i is) to load;
        `loaded_from`: the tier the step will read them from, when not their own (brought
        there first: promoted, pulled). Counts the others in `recomputed_chunks`."""
        with self._lock:
            self.decisions += 1
            count = len(tiers)
            rate, per_chunk_s = self._estimates()
            if tiers and rate is not None:
                priced = _priced_prefix(tiers, self.free_tiers.union(per_chunk_s))
                links = {t: self._link(per_chunk_s, t, loaded_from) for t in set(priced)}
                sizes = [self.chunk_tokens] * len(priced)
                count = best_load_prefix(priced, sizes, 1, prompt_tokens, rate, links)[0]
            self.recomputed_chunks += len(tiers) - count
            if count:
                used = [loaded_from or tier for tier in tiers[:count]]
                self._loads[request_id] = dict(Counter(used))
            return count

    def _link(self, per_chunk_s: dict[str, float], tier: str, loaded_from: str) -> TierLink:
        """How one chunk of `tier` reaches the engine (a chunk a byte, priced `margin` times
        its measured time): its own tier's time, plus the step's load from `loaded_from` when
        it is brought there first."""
        seconds = 0.0 if tier in self.free_tiers else per_chunk_s.get(tier, 0.0)
        if loaded_from and loaded_from != tier and loaded_from not in self.free_tiers:
            seconds += per_chunk_s.get(loaded_from, 0.0)
        return TierLink(1 / max(seconds * self.margin, 1e-30))

    def observe_fetch(self, tier: str, chunks: int, seconds: float) -> None:
        """Chunks of `tier` read in `seconds` outside any step (staged for a request, or
        probed); the last `fetch_samples` price the tier, so its figure follows it."""
        if chunks > 0:
            with self._lock:
                samples = self._fetched.setdefault(tier, deque(maxlen=self.fetch_samples))
                samples.append(seconds / chunks)

    def estimates(self) -> tuple[PrefillRate | None, dict[str, float]]:
        with self._lock:
            return self._estimates()

    def _estimates(self) -> tuple[PrefillRate | None, dict[str, float]]:
        """The fitted compute rate (None until enough steps without loads) and seconds per chunk
        of each measured tier."""
        plain = [s for s in self.steps if not s.chunks]
        if len(plain) < self.min_compute_steps:
            return None, {}
        fitted = fit_nonnegative(
            {
                "fixed_s": np.ones(len(plain)),
                "per_token_s": np.array([s.tokens for s in plain]),
                "per_token_pair_s": np.array([s.pairs for s in plain]),
            },
            np.array([s.seconds for s in plain]),
        )
        rate = PrefillRate(**fitted)
        residuals: dict[str, list[float]] = {}
        for step in self.steps:
            if len(step.chunks) == 1:
                ((tier, chunks),) = step.chunks.items()
                extra_s = step.seconds - rate.compute_s(step.tokens) - _pairs_s(rate, step)
                residuals.setdefault(tier, []).append(max(0.0, extra_s) / chunks)
        for tier, samples in self._fetched.items():
            residuals.setdefault(tier, []).extend(samples)
        return rate, {tier: float(np.median(values)) for tier, values in residuals.items()}

    # ---- observations --------------------------------------------------------------------
    def step_started(self, scheduled: list[tuple[str, int, int]], now_s: float) -> None:
        """A step begins: (request, tokens it computes, tokens already computed or loaded) for
        each scheduled request. Closes the step before it, if still open."""
        self.step_ended(now_s)
        tokens, pairs, chunks = 0, 0.0, Counter()
        with self._lock:
            for request_id, new, cached in scheduled:
                tokens += new
                pairs += new * (cached + (new + 1) / 2)
                chunks.update(self._loads.pop(request_id, {}))
        self._running = (now_s, tokens, pairs, dict(chunks))

    def step_ended(self, now_s: float) -> None:
        """The open step finished (a request of it finished, or the next step began)."""
        if self._running is not None:
            started, tokens, pairs, chunks = self._running
            if tokens:
                with self._lock:
                    self.steps.append(Step(tokens, pairs, chunks, now_s - started))
            self._running = None

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._loads.pop(request_id, None)


def _priced_prefix(tiers: list[str], known: frozenset[str]) -> list[str]:
    """The leading `tiers` up to the first one not in `known`."""
    for index, tier in enumerate(tiers):
        if tier not in known:
            return tiers[:index]
    return tiers


def _pairs_s(rate: PrefillRate, step: Step) -> float:
    """compute_s(tokens) counts pairs as if nothing was cached: correct to the step's pairs."""
    return (step.pairs - step.tokens * (step.tokens + 1) / 2) * rate.per_token_pair_s
