"""The connector's settings (kv_connector_extra_config), validated once, and the namespace,
KV layout and keys they imply. Runs in both halves of the connector at construction.

A stored block is one kv-head group's KV of one chunk (`head_group_size` heads, fleet-wide),
keyed by the chunk's chain key and the group's index, never by the TP rank: a rank stores and
loads each group it owns, so deployments of different TP sizes share blocks. key_scheme
"sglang" chains SGLang's page hashes instead of kvstore's chunk keys, in a namespace without
vLLM's paged layout: SGLang's HiCache backend reads and writes the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from kvstore.codec import CODEC_IDS
from kvstore.connectors.agent_settings import AgentSettings
from kvstore.connectors.vllm import compat
from kvstore.errors import ConfigError
from kvstore.fingerprint import model_fingerprint
from kvstore.keys import Namespace, chunk_keys
from kvstore.keys_sglang import HeadGroups, head_groups, sglang_page_hashes, shared_namespace
from kvstore.kvcopy.paged import PagedLayer, head_slice
from kvstore.layout import KVLayout
from kvstore.settings import parse_values, setting

KEY_SCHEMES = ("vllm", "sglang")
LOAD_THREADS = ("auto", "thread", "inline")
MAX_STAGE_THREADS = 16  # each holds one agent connection (a control thread in the agent)


@dataclass(frozen=True)
class ConnectorSettings(AgentSettings):
    """kv_connector_extra_config fields (docs/vllm.md); unknown keys are refused."""

    chunk_tokens: int = setting(256, help="tokens per stored chunk; a multiple of vLLM's", gt=0)
    codec: str = setting("raw", help="how blocks are stored", choices=tuple(CODEC_IDS))
    model_revision: str = setting("", help="mixed into the model fingerprint")
    verify_checksums: bool = setting(True, help="checksum every payload before using it")
    key_scheme: str = setting(
        "vllm",
        help="vllm, or sglang (SGLang's page hashes; chunk_tokens = its page size)",
        choices=KEY_SCHEMES,
    )
    head_group_size: int = setting(
        0, help="kv heads per stored block, fleet-wide; 0: this rank's heads", ge=0
    )
    load_thread: str = setting(
        "auto", help="where layer-wise loads copy (worker.py)", choices=LOAD_THREADS
    )
    stage_threads: int = setting(
        2,
        help="requests staged at once (disk promotions, pulls from other hosts)",
        ge=1,
        le=MAX_STAGE_THREADS,
    )
    # KV events (--kv-events-config): the metadata service whose event stream tells this
    # host's evictions; its token file; how many announced chunks are remembered for them.
    events_metadata_address: str = setting("", help="the metadata service of KV events")
    events_token_file: str = setting("", help="a metadata token for that event stream")
    events_max_chunks: int = setting(
        65_536, help="announced chunks remembered for their removals", gt=0
    )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        return cls(**parse_values(cls, extra or {}, "kv_connector_extra_config"))


@dataclass(frozen=True)
class EngineKV:
    """What a connector half derives from vLLM's config: the layout of one stored block (one
    head group of a chunk), the namespace, vLLM's block size, this rank's head groups and
    those of the whole model (which the scheduler looks up), and how vLLM's blocks are read."""

    layout: KVLayout
    namespace: Namespace
    block_size: int
    groups: HeadGroups | None = None  # None: one group, this rank's heads
    all_groups: HeadGroups | None = None  # None: this rank's
    key_scheme: str = "vllm"
    isa: str = ""  # vLLM's CPU attention ISA ("" off the CPU): see compat.paged_layer_view
    stage_roots: tuple[bytes, ...] = ()  # every pipeline stage's namespace root; (): this one

    def __post_init__(self) -> None:
        if self.groups is None:
            heads = self.layout.num_kv_heads
            object.__setattr__(self, "groups", HeadGroups(heads, heads, 0, 1))
        if self.all_groups is None:
            object.__setattr__(self, "all_groups", self.groups)

    @property
    def blocks_per_chunk(self) -> int:
        """vLLM blocks per chunk."""
        return self.layout.chunk_tokens // self.block_size

    @cached_property
    def root(self) -> bytes:
        return self.namespace.root_key()

    def block_layout(self, tail_blocks: int = 0) -> KVLayout:
        """The layout of one stored block: a whole chunk's, or a tail's of `tail_blocks`."""
        return (
            self.layout.with_tokens(tail_blocks * self.block_size) if tail_blocks else self.layout
        )

    def chain_keys(self, token_ids: Sequence[int], prior_hash: str | None = None) -> list[bytes]:
        """One key per full chunk of a prompt: kvstore's chunk keys, or SGLang's page hashes
        (as ASCII hex, as SGLang passes them; `prior_hash`: keys_sglang.sglang_chain_seed of a
        salted or LoRA request, as SGLang seeds it)."""
        chunk = self.layout.chunk_tokens
        if self.key_scheme == "sglang":
            return [h.encode() for h in sglang_page_hashes(token_ids, chunk, prior_hash)]
        return list(chunk_keys(self.namespace, token_ids, chunk))

    def block_keys(self, chain_keys: Sequence[bytes]) -> list[bytes]:
        """This rank's block keys of the chunks, chunk-major, group-minor."""
        return [key for chain in chain_keys for key in self.groups.keys(self.root, chain)]

    def lookup_keys(self, chain_keys: Sequence[bytes]) -> list[bytes]:
        """Every rank's block keys of the chunks, of every pipeline stage (its layer range's
        namespace), chunk-major: a chunk is a hit when all its blocks are."""
        roots = self.stage_roots or (self.root,)
        return [
            key
            for chain in chain_keys
            for root in roots
            for key in self.all_groups.keys(root, chain)
        ]

    @property
    def lookup_blocks_per_chunk(self) -> int:
        """How many of `lookup_keys` one chunk has."""
        return len(self.stage_roots or (self.root,)) * self.all_groups.count

    def parent_key(self, chain_key: bytes) -> bytes:
        """The block a chunk's first block chains on: the last group of the chunk before."""
        return self.groups.keys(self.root, chain_key)[-1] if chain_key else b""

    def rank_key(self, chain_key: bytes) -> bytes:
        """This rank's key of a chunk when it owns one group (the default head_group_size)."""
        return self.groups.keys(self.root, chain_key)[0] if chain_key else b""

    def group_view(self, paged: PagedLayer, group: int) -> PagedLayer:
        """Local head group `group` of one paged layer, as views."""
        return head_slice(paged, self.groups.local_heads(group))


def engine_kv(vllm_config, settings: ConnectorSettings) -> EngineKV:
    block_size = vllm_config.cache_config.block_size
    if settings.chunk_tokens % block_size:
        raise ConfigError(
            f"chunk_tokens {settings.chunk_tokens} must be a multiple of vLLM's block size "
            f"{block_size}; set kv_connector_extra_config.chunk_tokens accordingly"
        )
    num_layers, _, head_dim, dtype = compat.kv_shape(vllm_config)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    total_heads, tp_size = model.get_total_num_kv_heads(), parallel.tensor_parallel_size
    groups = head_groups(
        total_heads, tp_size, compat.tp_rank(vllm_config), settings.head_group_size
    )
    every = head_groups(total_heads, 1, 0, groups.group_heads)  # the model's whole grid
    layout = KVLayout(
        num_layers, groups.group_heads, head_dim, dtype, settings.chunk_tokens, settings.codec
    )
    isa = compat.attn_isa(vllm_config)
    fingerprint = model_fingerprint(
        Path(model.model),
        settings.model_revision or model.revision or "",
        compat.kv_affecting_settings(vllm_config),
    )
    engine_layout = _engine_layout(vllm_config, settings, isa)
    stages, stage = compat.pipeline_stages(vllm_config)
    namespaces = [
        shared_namespace(
            fingerprint,
            replace(layout, num_layers=stop - start),
            total_heads,
            (start, stop),
            settings.tenant,
            settings.salt,
            engine_layout,
        )
        for start, stop in stages
    ]
    return EngineKV(
        layout,
        namespaces[stage],
        block_size,
        groups,
        every,
        settings.key_scheme,
        isa,
        tuple(n.root_key() for n in namespaces),
    )


def _engine_layout(vllm_config, settings: ConnectorSettings, isa: str) -> str:
    """ "" (engine-neutral) for the sglang scheme, which needs K/V in canonical order; else
    vLLM's paged layout, whose bytes only such engines read."""
    if settings.key_scheme == "vllm":
        return compat.paged_layout_id(vllm_config)
    if isa and isa not in compat.CPU_CANONICAL_ISAS:
        raise ConfigError(
            f"key_scheme sglang needs K/V in canonical order; vLLM's CPU attention ISA {isa!r} "
            f"tiles its blocks (use a dtype/block size giving {compat.CPU_CANONICAL_ISAS}, "
            'or key_scheme "vllm")'
        )
    return ""
