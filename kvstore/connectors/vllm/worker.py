"""The worker half of the connector: copies chunks between the node agent's shared arena and
vLLM's paged KV cache. Loads run layer by layer (layerwise.py), so the attention of layer i
waits only for layer i; each layer is copied out of the shared page into vLLM's blocks (or a
private buffer) and hashed in the same pass, and a chunk whose digest is not the checksum it
was loaded with is a load error (recomputed), so a page reused under a stale view can never
become KV. A chunk is
one block per head group this rank owns (chunk-major, group-minor). Saves are saves.py's.
Runs in each vLLM worker process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.client import LoadedBlocks
from kvstore.connectors.vllm import compat
from kvstore.connectors.vllm.agent import AgentConnection
from kvstore.connectors.vllm.config import ConnectorSettings, EngineKV
from kvstore.connectors.vllm.layerwise import LayerwiseLoad, PooledLoad
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec
from kvstore.connectors.vllm.saves import SavePipeline
from kvstore.cores import spare_cpus
from kvstore.errors import ConfigError, KVStoreError
from kvstore.kvcopy.engine import BlockIndex, ChunkCopier, LayerLoad
from kvstore.kvcopy.paged import PagedLayer, check_paged_layer
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _CopyIn:
    """One loaded block to copy into the engine this step: its payload, the running digest of
    the bytes copied, the head group it fills, its layout (a chunk's or a tail's), and its
    engine blocks' index per KV cache group."""

    payload: torch.Tensor
    digest: Hasher
    group: int
    layout: KVLayout
    indexes: dict[int, BlockIndex]


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        kv: EngineKV,
        groups: compat.CacheGroups = compat.ONE_GROUP,
    ) -> None:
        self.settings = settings
        self.kv = kv
        self.groups = groups
        self._layer_groups: list[int] = []  # per payload layer: its KV cache group
        self.agent = AgentConnection(settings, "vllm-worker")
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_indexes: dict[str, int] = {}
        self._load: LayerwiseLoad | PooledLoad | None = None
        self._specs: list[LoadSpec] = []  # the step's loads
        self._loaded: list[tuple[LoadSpec, LoadedBlocks | None]] = []  # as the agent answered
        self.fetch_s = 0.0  # how long the step's loads waited for the agent's answers
        self._digests: list[list[Hasher | None]] = []  # per load, per block (None: unused)
        self._plan: list[_CopyIn] = []  # the step's copies, for every layer
        self._loader: ChunkCopier | None = None  # the forward's share of the loads
        self._helper: ChunkCopier | None = None  # the load helper's (the CPU: load_thread auto)
        self._helper_cpus: frozenset[int] | None = None  # its cores, found at the first load
        self._load_thread = False
        self.failed_block_ids: set[int] = set()
        self._finished_loads: set[str] = set()  # asynchronous loads done (or failed), by request
        self._failed_loads: set[str] = set()
        self.stats = {
            "loaded_blocks": 0,
            "loaded_bytes": 0,
            "helper_loaded_blocks": 0,
            "load_s": 0.0,
            "saved_blocks": 0,
            "saved_bytes": 0,
            "load_failures": 0,
            "save_failures": 0,
            "verify_failures": 0,
            "saves_dropped_after_load_errors": 0,
        }
        self.saves = SavePipeline(settings, kv, self.agent, self.stats, groups)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches; ConfigError naming what the copy engine cannot copy
        (a shape, dtype or layout), never a silent wrong copy later."""
        self.kv_caches = {name: kv_caches[name] for name in compat.layer_order(kv_caches)}
        self._layer_indexes = {name: index for index, name in enumerate(self.kv_caches)}
        unknown = [
            name
            for name in self.kv_caches
            if self.groups.of_layer and name not in self.groups.of_layer
        ]
        if unknown:
            raise ConfigError(f"KV caches {unknown[:3]} belong to no KV cache group vLLM named")
        self._layer_groups = [self.groups.of_layer.get(name, 0) for name in self.kv_caches]
        self.saves.layer_groups = self._layer_groups
        if len(self.kv_caches) != self.kv.layout.num_layers:
            raise ValueError(
                f"vLLM registered {len(self.kv_caches)} KV caches; the layout expects "
                f"{self.kv.layout.num_layers} attention layers"
            )
        rank_heads = self.kv.groups.count * self.kv.layout.num_kv_heads
        for name, cache in self.kv_caches.items():
            if cache.dim() == 4 and cache.shape[1] != rank_heads:
                raise ConfigError(
                    f"KV cache {name!r} holds {cache.shape[1]} kv heads; this "
                    f"rank's head groups cover {rank_heads}"
                )
            paged = compat.paged_layer_view(cache, self.kv.isa)
            for group in range(self.kv.groups.count):
                check_paged_layer(
                    name, self.kv.group_view(paged, group), self.kv.layout, self.kv.block_size
                )
        first = next(iter(self.kv_caches.values()))
        if self.kv.isa in compat.CPU_CANONICAL_ISAS:
            compat.check_cpu_views(
                self.kv.isa,
                first.dtype,
                self.kv.block_size,
                first.shape[1],
                self.kv.layout.head_dim,
            )
        device = first.device
        self._loader = ChunkCopier(self.kv.layout, self.kv.block_size, device)
        self._load_thread = _load_thread(self.settings.load_thread, self._loader.on_cuda)
        if self.settings.load_thread == "auto" and not self._loader.on_cuda:
            self._helper = ChunkCopier(self.kv.layout, self.kv.block_size, device)
        self.saves.copier = ChunkCopier(self.kv.layout, self.kv.block_size, device)

    # ---- loads -----------------------------------------------------------------------------
    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        self._load = None
        self.saves.expect(meta.saves)
        if not meta.loads:
            return
        # Layer i of a payload is the i-th registered KV cache, for loads and saves alike.
        started = time.perf_counter()
        self._specs, self._loaded, self._digests, self._plan = list(meta.loads), [], [], []
        names = list(self.kv_caches)
        tensors = [compat.paged_layer_view(self.kv_caches[name], self.kv.isa) for name in names]
        # CUDA, on the forward's thread: loads go after the compute stream's work so far
        # (vLLM may zero new blocks there), as vLLM's own offloader orders them
        self._loader.after_compute()
        helper_cpus = self._helper_cores(meta.loads)
        if helper_cpus:  # the helper takes the pins' answer: the forward waits for no agent
            asked = [(spec, self._ask_load(spec)) for spec in meta.loads]
            self._load = PooledLoad(
                names,
                lambda: self._prepare(asked),
                lambda layer, unit, helper: self._copy_unit_in(tensors, layer, unit, helper),
                helper_cpus,
            )
        else:
            self._prepare([(spec, self._ask_load(spec)) for spec in meta.loads])
            self._load = LayerwiseLoad(
                names,
                lambda i: self._copy_layer_in(i, tensors[i], self._loader, self._plan),
                background=self._load_thread,
            )
        self.stats["load_s"] += time.perf_counter() - started

    def _prepare(self, asked: list) -> int:
        """The agent's answers to the step's loads, their digests and the copy plan (on the
        load helper's thread where there is one); the plan's chunk layers per layer."""
        started = time.perf_counter()
        for spec, answer in asked:
            self._loaded.append((spec, self._fetched(spec, answer)))
        self.fetch_s = time.perf_counter() - started
        self._digests = [self._new_digests(spec, loaded) for spec, loaded in self._loaded]
        self._plan = self._copy_plan()
        return len(self._plan)

    def _ask_load(self, spec: LoadSpec) -> Callable[[], LoadedBlocks] | None:
        """Send the load (the pins) of `spec`'s chunks; None without an agent, or when sending
        failed (its chunks are then load errors)."""
        try:
            if self.agent.client is not None:
                tail = [spec.tail_key] if spec.tail_blocks else []
                return self.agent.client.load_sent(  # verified as copied, not here
                    self.settings.tenant,
                    self.kv.block_keys([*spec.keys, *tail]),
                    timeout_s=self.settings.load_timeout_s,
                )
        except KVStoreError as exc:
            logger.warning("kvstore load failed (%s); recomputing", exc)
        return None

    def _fetched(self, spec: LoadSpec, answer) -> LoadedBlocks | None:
        """The pinned chunks of `spec`, as the agent answered; chunks that cannot be had are
        load errors."""
        loaded = None
        try:
            loaded = answer() if answer is not None else None
        except KVStoreError as exc:
            # Not dropped here: earlier loads of this step are pinned through this connection.
            logger.warning("kvstore load failed (%s); recomputing", exc)
        got = len(loaded) // self.kv.groups.count if loaded is not None else 0
        if got < spec.chunks:
            first = max(got * self.kv.blocks_per_chunk, spec.skip_blocks)
            self._fail_blocks(spec, first, self._end_block(spec))
            self.stats["load_failures"] += spec.chunks - got
        return loaded

    def _end_block(self, spec: LoadSpec) -> int:
        """The engine block after the last one the load fills (its tail's included)."""
        return len(spec.keys) * self.kv.blocks_per_chunk + spec.tail_blocks

    def _chunk_blocks(self, spec: LoadSpec, cache_group: int, chunk: int) -> list[int]:
        """The engine blocks stored block `chunk` of the load fills: a whole chunk's, or after
        the whole chunks the tail's."""
        per_chunk = self.kv.blocks_per_chunk
        count = per_chunk if chunk < len(spec.keys) else spec.tail_blocks
        return spec.block_ids[cache_group][chunk * per_chunk : chunk * per_chunk + count]

    def _new_digests(self, spec: LoadSpec, loaded: LoadedBlocks | None) -> list:
        """A running xxh3 per loaded block of a whole chunk that has engine blocks to fill
        (others are not copied)."""
        if loaded is None:
            return []
        per_chunk, groups = self.kv.blocks_per_chunk, self.kv.groups.count
        chunks = len(loaded) // groups
        ends = [(c + 1) * per_chunk for c in range(len(spec.keys))] + [self._end_block(spec)]
        return [
            Hasher() if ends[j // groups] > spec.skip_blocks else None
            for j in range(chunks * groups)
        ]

    def _fail_blocks(self, spec: LoadSpec, first: int, stop: int | None = None) -> None:
        """Engine blocks [first, stop) of every KV cache group are load errors (recomputed);
        the request's saves are dropped from now on (their chunks attended to those blocks).
        An asynchronous load fails whole: vLLM computes its request from the first token."""
        if spec.asynchronous:
            self._failed_loads.add(spec.req_id)
            return
        for ids in spec.block_ids:
            self.failed_block_ids.update(compat.live_blocks(ids[first:stop]))
        self.saves.load_failed(spec.req_id)

    def _copy_plan(self) -> list[_CopyIn]:
        """Each loaded block to copy this step, with its engine blocks' index per KV cache
        group, built once for every layer."""
        plan = []
        for (spec, loaded), digests in zip(self._loaded, self._digests, strict=True):
            for payload, digest in enumerate(digests):
                if digest is None:
                    continue
                chunk, group = divmod(payload, self.kv.groups.count)
                indexes = {
                    cache_group: self._block_index(spec, cache_group, chunk)
                    for cache_group in set(self._layer_groups)
                }
                layout = self.kv.block_layout(0 if chunk < len(spec.keys) else spec.tail_blocks)
                plan.append(_CopyIn(loaded.payloads[payload], digest, group, layout, indexes))
        return plan

    def _block_index(self, spec: LoadSpec, cache_group: int, chunk: int) -> BlockIndex:
        """The engine blocks stored block `chunk` fills: past the prefix the engine has, and
        past a sliding-window group's null blocks (vLLM's, before its window)."""
        blocks = self._chunk_blocks(spec, cache_group, chunk)
        first = max(0, spec.skip_blocks - chunk * self.kv.blocks_per_chunk)
        while first < len(blocks) and blocks[first] == compat.NULL_BLOCK_ID:
            first += 1
        return self._loader.block_index(blocks, range(min(first, len(blocks)), len(blocks)))

    def _helper_cores(self, loads: list[LoadSpec]) -> frozenset[int]:
        """The load helper's cores, where there is a helper (the CPU: load_thread auto), a
        step that loads two chunks or more, and cores vLLM left free (kvstore/cores.py, looked
        up once, at the first such load); else none."""
        chunks = sum(len(spec.keys) + bool(spec.tail_blocks) for spec in loads)
        if self._helper is None or chunks * self.kv.groups.count < 2:
            return frozenset()
        if self._helper_cpus is None:
            self._helper_cpus = spare_cpus()
            logger.info("kvstore load helper cores: %s", sorted(self._helper_cpus) or "none")
        return self._helper_cpus

    def _copy_unit_in(self, tensors: list, layer: int, unit: int, helper: bool) -> None:
        """One chunk layer of the plan, on the helper's thread or the forward's (PooledLoad)."""
        loader = self._helper if helper else self._loader
        self._copy_layer_in(layer, tensors[layer], loader, self._plan[unit : unit + 1])

    def _copy_layer_in(
        self, layer: int, paged: PagedLayer, loader: ChunkCopier, copies: list[_CopyIn]
    ) -> None:
        cache_group = self._layer_groups[layer]
        loads = []
        for copy in copies:
            start, stop = copy.layout.layer_range(layer)
            view = self.kv.group_view(paged, copy.group)
            payload = copy.payload[start:stop]
            loads.append(
                LayerLoad(payload, copy.digest, view, copy.indexes[cache_group], copy.layout)
            )
        loader.load_layers(loads)  # CUDA: adjacent pages go up in one DMA
        loader.record(layer)

    def _mismatched(self, loaded: LoadedBlocks, digests: list) -> list[int]:
        """Positions of the loaded blocks whose copies are not the blocks' bytes."""
        if not self.settings.verify_checksums:
            return []
        checksums = loaded.checksums
        return [
            index
            for index, digest in enumerate(digests)
            if digest is not None and digest.intdigest() != checksums[index]
        ]

    def _verified_blocks(self, spec: LoadSpec, loaded: LoadedBlocks, mismatched: list) -> int:
        """After every layer was copied: how many leading whole chunks' private copies are
        the blocks that were loaded, in blocks. The first that is not (its page was reused,
        or corrupted) fails with every later chunk: its engine blocks are load errors,
        recomputed by vLLM."""
        groups = self.kv.groups.count
        blocks = len(loaded) // groups * groups  # the loaded blocks of whole chunks
        if not mismatched:
            return blocks
        chunk = mismatched[0] // groups
        self._fail_blocks(spec, max(chunk * self.kv.blocks_per_chunk, spec.skip_blocks))
        self.stats["verify_failures"] += blocks // groups - chunk
        self.stats["load_failures"] += blocks // groups - chunk
        logger.warning("chunk %d failed its checksum as copied; recomputing", chunk)
        return chunk * groups

    def wait_for_layer(self, layer_name: str) -> None:
        if self._load is not None:
            self._load.wait(layer_name)
            self._loader.wait(self._layer_indexes[layer_name])  # CUDA: the stream, not the host

    def finish_load(self) -> None:
        """After the forward: release pins and count what arrived."""
        failed = False
        if self._load is not None:
            self._load.join()
            self._loader.synchronize()
            failed = self._load.error is not None
            if isinstance(self._load, PooledLoad):  # in blocks: its chunk layers / layers
                copies = self._load.helper_copies
                self.stats["helper_loaded_blocks"] += round(copies / len(self.kv_caches))
            if failed:
                for spec in self._specs:
                    self._fail_blocks(spec, spec.skip_blocks)
        self._finished_loads.update(spec.req_id for spec in self._specs if spec.asynchronous)
        if len(self._digests) != len(self._loaded):  # failed while fetching: nothing copied
            self._digests = [[] for _ in self._loaded]
        for (spec, loaded), digests in zip(self._loaded, self._digests, strict=True):
            if loaded is None:
                continue
            mismatched = [] if failed else self._mismatched(loaded, digests)
            if not failed:
                good = self._verified_blocks(spec, loaded, mismatched)
                if spec.req_id in self._failed_loads:  # asynchronous: none of it is used
                    good = 0
                self.stats["loaded_blocks"] += good
                self.stats["loaded_bytes"] += sum(p.numel() for p in loaded.payloads[:good])
            self._release(loaded, mismatched)
        self._specs, self._loaded, self._digests, self._plan = [], [], [], []
        self._load = None
        self.agent.drop_if_broken()

    def _release(self, loaded: LoadedBlocks, suspect: list[int]) -> None:
        """Unpin, without waiting for the answer (the next call reads it): the step's output
        does not wait for the agent."""
        try:
            self.agent.client.release(loaded, suspect, wait=False)
        except (KVStoreError, AttributeError) as exc:
            logger.info("release after a lost agent: %s", exc)

    def take_failed_block_ids(self) -> set[int]:
        """The step's load errors, its load finished (and verified) first: with speculative
        decoding vLLM asks before wait_for_save, and must hear of this step's failures now."""
        self.finish_load()
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """The asynchronous loads finished since the last call, by request, and the failed
        ones among them (vLLM's finished_recving and failed_recving)."""
        self.finish_load()
        finished, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return finished, failed

    # ---- saves -----------------------------------------------------------------------------
    def save_layer(self, meta: KVStoreConnectorMetadata, layer_name: str, kv_layer) -> None:
        layer = self._layer_indexes.get(layer_name)
        if meta.saves and layer is not None:
            self.saves.save_layer(meta.saves, layer, compat.paged_layer_view(kv_layer, self.kv.isa))

    def finish_save(self) -> None:
        """End of step: commit the chunks whose copies are done (on the CPU: all of them)."""
        self.saves.end_step()

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        return self.saves.finished_saving(finished_req_ids)

    def commit_all(self) -> None:
        """Wait for every submitted save and commit it (preemption, shutdown)."""
        self.saves.commit_ready(block=True)

    def close(self) -> None:
        self.finish_load()
        self.commit_all()
        self.agent.drop()


def _load_thread(setting: str, on_cuda: bool) -> bool:
    """Whether the forward's share of the loads copies on a background thread ("auto": on
    CUDA, where it only submits; on the CPU the forward's thread copies it, beside a helper
    on the cores vLLM left free, where it left some: layerwise.py)."""
    return {"auto": on_cuda, "thread": True, "inline": False}[setting]
