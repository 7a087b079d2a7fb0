"""The worker half of the connector: copies chunks between the node agent's shared arena and
vLLM's paged KV cache. Loads run layer by layer on a background thread, so layer i+1 loads
while layer i computes; each layer is copied out of the shared page into a private buffer and
hashed in the same pass, and a chunk whose digest is not the checksum it was loaded with is a
load error (recomputed), so a page reused under a stale view can never become KV. Saves copy
each layer as its attention finishes and commit at the end of the step. Runs in each vLLM
worker process.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import xxhash

from connectors.vllm import compat
from connectors.vllm.agent import AgentConnection
from connectors.vllm.config import ConnectorSettings, EngineKV
from connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.client import LoadedBlocks, SaveReservation
from kvstore.errors import KVStoreError
from kvstore.kvcopy.engine import ChunkCopier
from kvstore.kvcopy.paged import check_paged_layer

logger = logging.getLogger(__name__)


class LayerwiseLoad:
    """One step's loads: a thread fills layer after layer; `wait(layer)` blocks on one."""

    def __init__(self, names: list[str], copy_layer) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.done = [threading.Event() for _ in names]
        self._copy_layer = copy_layer
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index, event in enumerate(self.done):
                self._copy_layer(index)
                event.set()
        except BaseException as exc:  # reported as load errors; never leave a waiter hanging
            self.error = exc
            logger.exception("layer-wise load failed")
        finally:
            for event in self.done:
                event.set()

    def wait(self, layer_name: str) -> None:
        index = self.index.get(layer_name)
        if index is not None:
            self.done[index].wait()

    def join(self) -> None:
        self._thread.join()


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV) -> None:
        self.settings = settings
        self.kv = kv
        self.agent = AgentConnection(settings.socket_path, "vllm-worker", settings.credential_file)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_indexes: dict[str, int] = {}
        self._load: LayerwiseLoad | None = None
        self._loaded: list[tuple[LoadSpec, LoadedBlocks]] = []
        self._digests: list[list[xxhash.xxh3_64 | None]] = []  # per load, per chunk (None: unused)
        self._loader: ChunkCopier | None = None  # on the load thread
        self._saver: ChunkCopier | None = None  # on the forward's thread
        self._saves: list[tuple[SaveSpec, SaveReservation]] | None = None
        self._save_digests: dict[int, list[xxhash.xxh3_64]] = {}  # per save id, per chunk
        self._layers_saved = 0  # layers saved this step
        self._saves_in_order = True  # so far in payload order: the running digests are valid
        self.failed_block_ids: set[int] = set()
        self.stats = {"loaded_blocks": 0, "loaded_bytes": 0, "load_s": 0.0, "saved_blocks": 0,
                      "saved_bytes": 0, "load_failures": 0, "save_failures": 0,
                      "verify_failures": 0}  # fmt: skip

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches; ConfigError naming what the copy engine cannot copy
        (a shape, dtype or layout), never a silent wrong copy later."""
        self.kv_caches = dict(kv_caches)
        self._layer_indexes = {name: index for index, name in enumerate(self.kv_caches)}
        if len(self.kv_caches) != self.kv.layout.num_layers:
            raise ValueError(
                f"vLLM registered {len(self.kv_caches)} KV caches; the layout expects "
                f"{self.kv.layout.num_layers} attention layers"
            )
        for name, cache in self.kv_caches.items():
            check_paged_layer(name, compat.paged_layer_view(cache), self.kv.layout,
                              self.kv.block_size)  # fmt: skip
        device = next(iter(self.kv_caches.values())).device
        self._loader = ChunkCopier(self.kv.layout, self.kv.block_size, device)
        self._saver = ChunkCopier(self.kv.layout, self.kv.block_size, device)

    # ---- loads -----------------------------------------------------------------------------
    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        self._load = None
        if not meta.loads:
            return
        # Layer i of a payload is the i-th registered KV cache, for loads and saves alike.
        started = time.perf_counter()
        self._loaded = [(spec, self._fetch(spec)) for spec in meta.loads]
        self._digests = [self._new_digests(spec, loaded) for spec, loaded in self._loaded]
        names = list(self.kv_caches)
        tensors = [compat.paged_layer_view(self.kv_caches[name]) for name in names]
        self._load = LayerwiseLoad(names, lambda i: self._copy_layer_in(i, tensors[i]))
        self.stats["load_s"] += time.perf_counter() - started

    def _fetch(self, spec: LoadSpec) -> LoadedBlocks | None:
        """Pin the chunks in the arena; chunks that cannot be had are load errors."""
        loaded = None
        try:
            if self.agent.client is not None:
                loaded = self.agent.client.load(  # verified as copied, not here
                    self.settings.tenant, [self.kv.rank_key(k) for k in spec.keys],
                    timeout_s=self.settings.load_timeout_s, verify=False,
                )  # fmt: skip
        except KVStoreError as exc:
            # Not dropped here: earlier loads of this step are pinned through this connection.
            logger.warning("kvstore load failed (%s); recomputing", exc)
        got = len(loaded) if loaded is not None else 0
        if got < len(spec.keys):
            per_chunk = self.kv.blocks_per_chunk
            missing = spec.block_ids[
                max(got * per_chunk, spec.skip_blocks) : len(spec.keys) * per_chunk
            ]
            self.failed_block_ids.update(missing)
            self.stats["load_failures"] += len(spec.keys) - got
        return loaded

    def _new_digests(self, spec: LoadSpec, loaded: LoadedBlocks | None) -> list:
        """A running xxh3 per loaded chunk that has blocks to fill (others are not copied)."""
        if loaded is None:
            return []
        per_chunk = self.kv.blocks_per_chunk
        return [
            xxhash.xxh3_64() if (chunk + 1) * per_chunk > spec.skip_blocks else None
            for chunk in range(len(loaded))
        ]

    def _copy_layer_in(self, layer: int, paged: torch.Tensor) -> None:
        start, stop = self.kv.layout.layer_range(layer)
        for (spec, loaded), digests in zip(self._loaded, self._digests, strict=True):
            for chunk, digest in enumerate(digests):
                if digest is None:
                    continue
                blocks = self._chunk_blocks(spec.block_ids, chunk)
                first = chunk * len(blocks)
                keep = [i for i in range(len(blocks)) if first + i >= spec.skip_blocks]
                payload = loaded.payloads[chunk][start:stop]
                self._loader.load_layer(payload, digest, paged, blocks, keep)
        self._loader.record(layer)

    def _verified_chunks(self, spec: LoadSpec, loaded: LoadedBlocks, digests: list) -> int:
        """After every layer was copied: how many leading chunks' private copies are the
        blocks that were loaded. The first that is not (its page was reused, or corrupted)
        fails with every later chunk: its blocks are load errors, recomputed by vLLM."""
        for chunk, digest in enumerate(digests):
            if not self.settings.verify_checksums or digest is None:
                continue
            if digest.intdigest() != loaded.checksums[chunk]:
                first = max(chunk * self.kv.blocks_per_chunk, spec.skip_blocks)
                self.failed_block_ids.update(spec.block_ids[first:])
                self.stats["verify_failures"] += len(digests) - chunk
                self.stats["load_failures"] += len(digests) - chunk
                logger.warning("chunk %d failed its checksum as copied; recomputing", chunk)
                return chunk
        return len(digests)

    def _chunk_blocks(self, block_ids: list[int], chunk: int) -> list[int]:
        per_chunk = self.kv.blocks_per_chunk
        return block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]

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
            if failed:
                for spec, _ in self._loaded:
                    self.failed_block_ids.update(spec.block_ids[spec.skip_blocks :])
        for (spec, loaded), digests in zip(self._loaded, self._digests, strict=True):
            if loaded is None:
                continue
            if not failed:
                good = self._verified_chunks(spec, loaded, digests)
                self.stats["loaded_blocks"] += good
                self.stats["loaded_bytes"] += sum(p.numel() for p in loaded.payloads[:good])
            self._release(loaded)
        self._loaded, self._digests, self._load = [], [], None
        self.agent.drop_if_broken()

    def _release(self, loaded: LoadedBlocks) -> None:
        try:
            self.agent.client.release(loaded)
        except (KVStoreError, AttributeError) as exc:
            logger.info("release after a lost agent: %s", exc)

    def take_failed_block_ids(self) -> set[int]:
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    # ---- saves -----------------------------------------------------------------------------
    def save_layer(self, meta: KVStoreConnectorMetadata, layer_name: str, kv_layer) -> None:
        if not meta.saves:
            return
        if self._saves is None:
            self._saves = self._reserve(meta.saves)
        layer = self._layer_index(layer_name)
        if layer is None:
            return
        self._saves_in_order &= layer == self._layers_saved
        self._layers_saved += 1
        start, stop = self.kv.layout.layer_range(layer)
        paged = compat.paged_layer_view(kv_layer)
        self._saver.after_compute()  # CUDA: the layer's attention wrote it on the compute stream
        for spec, reservation in self._saves:
            digests = self._save_digests[reservation.save_id]
            for chunk, payload in enumerate(reservation.payloads):
                if payload is not None:
                    blocks = self._chunk_blocks(spec.block_ids, chunk)
                    digest = digests[chunk] if self._saves_in_order else None
                    self._saver.save_layer(paged, blocks, payload[start:stop], digest)

    def _layer_index(self, layer_name: str) -> int | None:
        return self._layer_indexes.get(layer_name)

    def _reserve(self, saves: list[SaveSpec]) -> list[tuple[SaveSpec, SaveReservation]]:
        reserved = []
        for spec in saves:
            try:
                if self.agent.client is None:
                    break
                reservation = self.agent.client.save(
                    self.settings.tenant, [self.kv.rank_key(k) for k in spec.keys],
                    self.kv.layout.payload_bytes,
                    first_parent=self.kv.rank_key(spec.first_parent) or None,
                    layout_hash=self.kv.layout.layout_hash,
                )  # fmt: skip
                reserved.append((spec, reservation))
                self._save_digests[reservation.save_id] = [
                    xxhash.xxh3_64() for _ in reservation.payloads
                ]
            except KVStoreError as exc:
                logger.warning("kvstore save skipped (%s)", exc)
                self.stats["save_failures"] += len(spec.keys)
        return reserved

    def finish_save(self) -> None:
        """End of step: commit every reserved chunk (all its layers are written by now)."""
        saves, self._saves = self._saves or [], None
        digests, self._save_digests = self._save_digests, {}
        complete = self._saves_in_order and self._layers_saved == self.kv.layout.num_layers
        complete &= self._saver is not None and not self._saver.on_cuda  # CUDA: agent hashes
        self._layers_saved, self._saves_in_order = 0, True
        if self._saver is not None:
            self._saver.synchronize()
        for _, reservation in saves:
            try:
                checksums = self._checksums(reservation, digests.get(reservation.save_id), complete)
                committed = self.agent.client.commit(reservation, checksums=checksums)
            except KVStoreError as exc:
                logger.warning("kvstore commit failed (%s)", exc)
                self.stats["save_failures"] += len(reservation.reserved_keys())
                continue
            self.stats["saved_blocks"] += committed
            self.stats["saved_bytes"] += committed * self.kv.layout.payload_bytes
        self.agent.drop_if_broken()

    @staticmethod
    def _checksums(reservation: SaveReservation, digests, complete: bool) -> list[int]:
        """The payloads' xxh3, hashed as they were written (every layer, in order); else []
        and the agent hashes them at commit."""
        if not complete or not digests:
            return []
        return [d.intdigest() for d, view in zip(digests, reservation.payloads, strict=True)
                if view is not None]  # fmt: skip

    def close(self) -> None:
        self.finish_load()
        self.agent.drop()
