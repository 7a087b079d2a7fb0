"""Everything that differs between vLLM releases, in one place (written against vllm 0.32).

Imported by the connector in both the scheduler and the worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.errors import ConfigError
from kvstore.kvcopy.paged import PagedLayer

SUPPORTED_VLLM = ("0.32",)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a scheduler step, as the connector needs it."""

    req_id: str
    block_ids: list[list[int]] | None  # full block table per KV cache group, or None
    new_block_ids: list[list[int]]  # blocks appended this step, per KV cache group
    num_computed_tokens: int
    num_scheduled_tokens: int
    prompt_token_ids: list[int] | None  # only for new requests


def scheduled_requests(scheduler_output) -> Iterator[ScheduledRequest]:
    """New and running requests of a step, with their block ids of every KV cache group."""
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(
            new.req_id,
            [list(ids) for ids in new.block_ids],
            [],
            new.num_computed_tokens,
            scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
            new.prompt_token_ids,
        )
    cached = scheduler_output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[index]
        blocks = [list(ids) for ids in new_ids] if new_ids else []
        resumed = req_id in cached.resumed_req_ids
        yield ScheduledRequest(
            req_id,
            blocks if resumed else None,
            [] if resumed else blocks,
            cached.num_computed_tokens[index],
            scheduler_output.num_scheduled_tokens.get(req_id, 0),
            None,
        )


def preempted_req_ids(scheduler_output) -> set[str]:
    """The requests preempted since the last step (their blocks are free again)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def allocated_block_ids(blocks) -> list[list[int]]:
    """The block table per KV cache group of the KVCacheBlocks vLLM hands to
    update_state_after_alloc."""
    return [list(ids) for ids in blocks.get_block_ids()]


def saves_outlive_steps() -> bool:
    """Whether saves complete after their step (CUDA: on the copy stream), so finished
    requests keep their blocks through vLLM's delayed free. On the CPU a save is committed
    within its step, and delaying frees would only hold blocks (and fail reset_prefix_cache).
    The scheduler and the workers must answer alike: both ask the platform."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


# CPU attention ISAs whose blocks hold, per head, K transposed ([head_dim, block_size]) then V
# rows ([block_size, head_dim]); others (amx) tile them: those bytes are not K/V as such.
CPU_CANONICAL_ISAS = ("vec", "vec16")


def paged_layer_view(kv_cache: torch.Tensor, isa: str = "") -> PagedLayer:
    """A layer's paged KV for the copy engine. CPU with a canonical ISA: the (K, V) pair of
    [num_blocks, block_size, kv_heads, head_dim] views of the kernel's own order; otherwise
    [num_blocks, kv_heads, block_size, 2 * head_dim], K then V along the last dim (copied
    consistently, but on a tiling CPU ISA the bytes are the kernel's, not K/V rows)."""
    if kv_cache.dim() != 4:
        raise ValueError(f"unsupported KV cache layout of shape {tuple(kv_cache.shape)}")
    if isa not in CPU_CANONICAL_ISAS:
        return kv_cache
    blocks, heads, block_size, two_dim = kv_cache.shape
    halves = kv_cache.view(blocks, heads, 2, block_size * two_dim // 2)
    keys = halves[:, :, 0].view(blocks, heads, two_dim // 2, block_size).permute(0, 3, 1, 2)
    values = halves[:, :, 1].view(blocks, heads, block_size, two_dim // 2).transpose(1, 2)
    return keys, values


def check_cpu_views(isa: str, dtype: torch.dtype, block_size: int, heads: int, head_dim: int):
    """ConfigError unless vLLM's own cache kernel writes K/V where paged_layer_view reads them
    (run once per worker: a kernel that changed its order must not become wrong KV)."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(2, heads, block_size, 2 * head_dim, dtype=dtype)
    key, value = torch.randn(2, block_size, heads, head_dim).to(dtype)
    key_cache, value_cache = cache.view(2, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_size, 2 * block_size)
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    keys, values = paged_layer_view(cache, isa)
    if not (torch.equal(keys[1], key) and torch.equal(values[1], value)):
        raise ConfigError(
            f"vLLM's CPU cache kernel (isa {isa}) no longer stores K/V as kvstore reads them; "
            "update kvstore/connectors/vllm/compat.py for this vLLM release"
        )


def attn_isa(vllm_config) -> str:
    """The CPU attention kernel family vLLM picks for this model ("" off the CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return _get_attn_isa(
        model.dtype,
        vllm_config.cache_config.block_size,
        model.get_head_size(),
        vllm_config.cache_config.cache_dtype,
    )


def tp_rank(vllm_config) -> int:
    """This worker's tensor-parallel rank; the scheduler (no TP group) speaks for rank 0."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:
        return 0


def paged_layout_id(vllm_config) -> str:
    """Names how vLLM lays out a paged block in memory on this machine: the platform, the CPU
    attention ISA (AMX tiles differ from vector layouts) and the block size. Blocks keyed
    by vLLM's own scheme are only shared between engines whose layout ids match."""
    from vllm.platforms import current_platform

    block_size = vllm_config.cache_config.block_size
    if not current_platform.is_cpu():
        return f"vllm-{current_platform.device_name}-bs{block_size}"
    return f"vllm-cpu-{attn_isa(vllm_config)}-bs{block_size}"


def kv_shape(vllm_config) -> tuple[int, int, int, str]:
    """(attention layers, kv heads per TP rank, head dim, KV dtype name) of the model."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    dtype = vllm_config.cache_config.cache_dtype
    if dtype in ("auto", None):
        dtype = str(model.dtype).removeprefix("torch.")
    return (
        model.get_num_layers(parallel),
        model.get_num_kv_heads(parallel),
        model.get_head_size(),
        dtype,
    )


def pipeline_stages(vllm_config) -> tuple[list[tuple[int, int]], int]:
    """Every pipeline stage's layer range [start, stop) of the model (vLLM's own split,
    VLLM_PP_LAYER_PARTITION included) and this process's stage (the scheduler's: 0)."""
    from vllm.distributed.utils import get_pp_indices

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    size, layers = parallel.pipeline_parallel_size, model.get_total_num_hidden_layers()
    stage = (parallel.rank // parallel.tensor_parallel_size) % size  # vLLM's DP x PP x TP order
    return [get_pp_indices(layers, s, size) for s in range(size)], stage


def kv_affecting_settings(vllm_config) -> dict:
    """The engine settings beside the model's files that change the KV of a token prefix; they
    enter the model fingerprint. Only those set away from their defaults are named, so a plain
    engine's fingerprint is the model files' alone, as the SGLang backend computes it (the KV
    dtype is in the block layout; the model's dtype is too, unless the cache dtype differs)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    overrides = model.hf_overrides
    if callable(overrides):  # a function rewrites the config: name it, it cannot be hashed
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    kv_cache_dtype = str(cache.cache_dtype)
    settings = {
        "dtype": str(model.dtype) if kv_cache_dtype != "auto" else None,
        "kv_cache_dtype": kv_cache_dtype,
        "calculate_kv_scales": bool(getattr(cache, "calculate_kv_scales", False)),
        "quantization": model.quantization,
        "quantization_config": model.quantization_config,
        "hf_overrides": overrides,
        "hf_config_path": model.hf_config_path,
        "model_weights": _weights_fingerprint(model.model_weights),
        "code_revision": model.code_revision,
        "disable_sliding_window": model.disable_sliding_window,
        "model_class_overrides": model.model_class_overrides,
    }
    return {name: value for name, value in settings.items() if value not in _DEFAULTS}


_DEFAULTS = (None, False, "", "auto", {}, [])


def _weights_fingerprint(model_weights: str) -> str:
    """vLLM loads the weights from `model_weights` instead of the model directory when set."""
    from kvstore.fingerprint import model_fingerprint

    return model_fingerprint(model_weights) if model_weights else ""


def hit_sources(shares: dict[str, int]) -> dict:
    """kvstore's token shares by tier as vLLM's CacheHitSource counts: this host's arena is
    HOST, its disk tier DISK, another host's tiers P2P (where the chunk was found, though
    the worker copies every chunk from the host arena)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    names = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "remote": CacheHitSource.P2P}
    return {names[where]: tokens for where, tokens in shares.items()}


NULL_BLOCK_ID = 0  # vLLM's null block (the pool's first), a placeholder never read as KV


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV cache groups as the connector serves them: one per attention type the hybrid
    KV cache manager keeps apart. `windows[g]` is group g's sliding window in tokens (None:
    full attention); `of_layer` maps each layer's name to its group."""

    windows: tuple[int | None, ...]
    of_layer: dict[str, int]

    @property
    def loads_asynchronously(self) -> bool:
        """Whether loads go through vLLM's asynchronous mode: vLLM 0.32 cannot map load
        errors reported as block ids back to requests when there are several groups (their
        block ids overlap), and stops its engine core on one; a failed asynchronous load is
        reported per request (failed_recving) and recomputed."""
        return len(self.windows) > 1


ONE_GROUP = CacheGroups((None,), {})  # no KV cache config: every layer in one full group


def cache_groups(kv_cache_config, block_size: int) -> CacheGroups:
    """The groups of vLLM's KV cache config (none given: one group of every layer).
    ConfigError naming what the connector cannot store correctly: state-space (Mamba) layers,
    whose state at a chunk boundary is not per-token KV; other attention kinds (MLA, chunked
    local, sinks, ...); a group whose block size is not the engine's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if kv_cache_config is None:
        return ONE_GROUP
    windows, of_layer = [], {}
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if isinstance(spec, MambaSpec):
            raise ConfigError(
                f"the kvstore connector does not support state-space (Mamba) layers (KV cache "
                f"group {index}, {kind}, layers {group.layer_names[:3]}...): their state at a "
                "chunk boundary is not stored; serve this model without the connector"
            )
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            raise ConfigError(
                f"the kvstore connector does not support KV cache group {index} of kind {kind} "
                f"(layers {group.layer_names[:3]}...): it stores full and sliding-window "
                "attention layers only"
            )
        if spec.block_size != block_size:
            raise ConfigError(
                f"KV cache group {index} has block size {spec.block_size}; the "
                f"connector copies blocks of {block_size}"
            )
        windows.append(spec.sliding_window if type(spec) is SlidingWindowSpec else None)
        of_layer.update(dict.fromkeys(group.layer_names, index))
    if not windows:
        raise ConfigError("the kvstore connector needs attention layers; this model has none")
    return CacheGroups(tuple(windows), of_layer)


def layer_order(names) -> list[str]:
    """Layer names in the model's layer order: the payload's layer i is the i-th, whichever
    order vLLM registers them in (the hybrid manager registers them group by group). Names
    without vLLM's one layer index ("model.layers.3.self_attn.attn") keep their order."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = list(names)
    try:
        return sorted(names, key=extract_layer_index)  # stable: ties keep their order
    except (AssertionError, ValueError):
        return names


def live_blocks(block_ids) -> list[int]:
    """The engine blocks of `block_ids` that hold KV (not vLLM's null placeholder)."""
    return [block for block in block_ids if block != NULL_BLOCK_ID]
