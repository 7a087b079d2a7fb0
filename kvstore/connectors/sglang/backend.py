"""`KVStoreHiCacheStorage`: SGLang's HiCache L3 storage over the host's kvstore node agent.

Built by SGLang's StorageBackendFactory in each scheduler process (one per TP rank); its
methods run on the cache controller's prefetch and backup threads. Zero copy (interface_v1):
host-pool pages are copied straight to and from the agent's shared arena, checksummed in the
same pass. Agent failures are misses and Falses, never exceptions: the engine recomputes.
A page is one block per kv-head group the rank owns, keyed by SGLang's page hash and the
group (kvstore.keys_sglang): vLLM's connector with key_scheme "sglang" and other TP sizes
with the same head_group_size share them.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from kvstore import errors
from kvstore.client import KVStoreClient
from kvstore.codec import CODEC_IDS
from kvstore.connectors.sglang import copies, pages
from kvstore.connectors.sglang.config import BackendSettings
from kvstore.connectors.sglang.stats import BackendStats
from kvstore.fingerprint import model_fingerprint
from kvstore.keys import Namespace
from kvstore.keys_sglang import HeadGroups, head_groups, shared_namespace

logger = logging.getLogger(__name__)
_MLA_GROUPS = HeadGroups(0, 0, 0, 1)  # no head axis: one block per page, every rank reads it
_FAILURES = (errors.KVStoreError, OSError)


class KVStoreHiCacheStorage(HiCacheStorage):
    """One TP rank's view of kvstore. MHA ranks store and load the head groups they own; MLA
    ranks share one copy, written by SGLang's storage writer (rank 0) and read by every rank.
    Thread-safe: the client serialises calls; counters take a lock."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise errors.ConfigError(
                'the kvstore HiCache backend is zero-copy only: add "interface_v1": 1 to '
                "--hicache-storage-backend-extra-config"
            )
        self.settings = BackendSettings.from_extra_config(extra)
        self.storage_config = storage_config
        self.stats = BackendStats()
        self.mem_pool_host = None
        self._format: pages.PageFormat | None = None
        self._groups = _MLA_GROUPS
        self._root = b""
        self._client: KVStoreClient | None = None
        self._client_lock = threading.Lock()
        self._next_connect_s = 0.0
        self._connect()  # best effort: a missing agent is a miss until it comes

    # ---- setup -----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Refuses (ConfigError) a pool whose layout or kind this backend cannot store."""
        config = self.storage_config
        if not config.is_mla_model:  # ConfigError for a head_group_size the heads do not tile
            self._groups = head_groups(
                mem_pool_host.head_num * config.tp_size,
                config.tp_size,
                config.tp_rank,
                self.settings.head_group_size,
            )
        self._format = pages.page_format(
            mem_pool_host, config.is_mla_model, self.settings.codec, self._groups.group_heads
        )
        self.mem_pool_host = mem_pool_host
        self.namespace = self._namespace(mem_pool_host)
        self._root = self.namespace.root_key()
        logger.info(
            "kvstore HiCache backend: %s, %d groups of %d-byte blocks, tp %d/%d, writer %s",
            self._format.layout_id,
            self._groups.count,
            self._format.payload_bytes,
            config.tp_rank,
            config.tp_size,
            config.is_storage_writer,
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's hybrid controller registers each host pool by name. Only the KV pool's
        pages are stored: a sidecar pool (an EAGLE draft's, SWA, Mamba, an indexer) is refused
        here, failing the attach with this message, since its pages would never be stored and
        SGLang's v2 calls for them would fail every backup and prefetch."""
        name = getattr(host_pool_name, "value", host_pool_name)
        if name != PoolName.KV.value:
            raise errors.ConfigError(
                f"the kvstore HiCache backend stores the KV pool only, not SGLang's {name!r} "
                "pool (an EAGLE draft, SWA, Mamba or indexer pool): run this model without "
                "--hicache-storage-backend kvstore, or without that pool"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _namespace(self, pool) -> Namespace:
        """MHA: the block layout (one head group), the model's kv heads and the layer range,
        never the rank: the namespace vLLM's connector derives with key_scheme "sglang".
        MLA: one for all ranks (and one per DCP shard). Different layer ranges never share."""
        config, settings = self.storage_config, self.settings
        model = settings.model_path or config.model_name or ""
        fingerprint = model_fingerprint(Path(model), settings.model_revision)
        layers = (pool.start_layer, pool.end_layer)
        if self._format.kv_layout is not None:
            return shared_namespace(
                fingerprint,
                self._format.kv_layout,
                self._groups.total_heads,
                layers,
                settings.tenant,
                settings.salt,
            )
        shard = (
            f"dcp{config.dcp_rank}of{config.dcp_size}"
            if config.is_mla_model
            else (f"kv{self._groups.total_heads}")
        )
        layout_id = f"{self._format.layout_id}|{shard}|layers{layers[0]}:{layers[1]}"
        return Namespace(fingerprint, layout_id, tenant=settings.tenant, salt=settings.salt)

    def _store_keys(self, keys: list[str]) -> list[bytes]:
        """The kvstore keys of SGLang page hashes, page-major, group-minor: the hash carries
        no model identity, so it is keyed by the namespace root and the head group."""
        return [k for key in keys for k in self._groups.keys(self._root, key.encode())]

    def _pages(self, blocks: int) -> int:
        return blocks // self._groups.count

    def _key_tokens(self) -> int:
        """The prompt tokens each stored key stands for (its page's, shared by its groups)."""
        if self._format is None:
            return 0
        return max(1, self._format.page_tokens // self._groups.count)

    # ---- the agent connection --------------------------------------------------------------
    def _connect(self) -> KVStoreClient | None:
        """The live client, reconnecting at most every reconnect_interval_s; None if down."""
        with self._client_lock:
            if self._client is not None and not self._client.broken:
                return self._client
            now = time.monotonic()
            if now < self._next_connect_s:
                return None
            self._next_connect_s = now + self.settings.reconnect_interval_s
            if self._client is not None:
                self._drop(self._client)
                self.stats.count(reconnects=1)
            self._client = None
            try:
                self._client = KVStoreClient(
                    self.settings.socket_path,
                    worker=f"sglang-tp{self.storage_config.tp_rank}",
                    timeout_s=self.settings.timeout_s,
                    credential_file=self.settings.credential_file or None,
                    answer_spin_us=self.settings.answer_spin_us,
                )
            except _FAILURES as exc:
                logger.warning(
                    "kvstore agent unavailable at %s: %s", self.settings.socket_path, exc
                )
            return self._client

    @staticmethod
    def _drop(client: KVStoreClient) -> None:
        try:
            client.close()
        except Exception:
            logger.debug("closing a broken kvstore client failed", exc_info=True)

    def _ready(self) -> KVStoreClient | None:
        return self._connect() if self._format is not None else None

    # ---- the hot path (interface_v1) -------------------------------------------------------
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading keys this host or another node can serve; 0 when the agent is down."""
        client = self._ready()
        hits = 0
        if client is not None and keys:
            try:
                found = client.lookup(
                    self.settings.tenant, self._store_keys(keys), chunk_tokens=self._key_tokens()
                ).total
                hits = self._pages(found)
            except _FAILURES as exc:
                logger.warning("kvstore lookup failed: %s", exc)
        self.stats.count(exists_calls=1, hit_pages=hits, miss_pages=len(keys) - hits)
        return hits

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the leading keys into their host pages; a False ends the usable prefix."""
        results = [False] * len(keys)
        client = self._ready()
        if client is None or not keys:
            self.stats.count(get_failed_pages=len(keys))
            return results
        started = time.perf_counter()
        starts = host_indices[:: self._format.page_tokens].tolist()
        loaded, suspect = None, ()
        try:
            loaded = client.load(
                self.settings.tenant,
                self._store_keys(keys),
                timeout_s=self.settings.load_timeout_s,
                verify=False,
            )
            for i in range(self._pages(len(loaded))):
                if not self._load_page(loaded, i, starts[i]):
                    logger.warning("kvstore page %s changed while it was read: a miss", keys[i])
                    suspect = range(i * self._groups.count, (i + 1) * self._groups.count)
                    break
                results[i] = True
        except _FAILURES as exc:
            logger.warning("kvstore load failed: %s", exc)
        finally:
            if loaded is not None:
                self._release(client, loaded, suspect)
        got = results.index(False) if False in results else len(results)
        results[got:] = [False] * (len(keys) - got)
        self.stats.record_get(
            got, len(keys) - got, got * self._page_bytes, time.perf_counter() - started
        )
        return results

    def _load_page(self, loaded, page: int, token_index: int) -> bool:
        """Every group of one page, each verified as it is copied."""
        blocks = slice(page * self._groups.count, (page + 1) * self._groups.count)
        return copies.load_page(
            self._format, token_index, loaded.payloads[blocks], loaded.checksums[blocks]
        )

    @property
    def _page_bytes(self) -> int:
        return self._groups.count * self._format.payload_bytes

    def _release(self, client: KVStoreClient, loaded, suspect=()) -> None:
        """Unpin a load; `suspect`: blocks whose copy failed its checksum (the agent purges
        them if their stored bytes are corrupt)."""
        try:
            client.release(loaded, suspect)
        except _FAILURES as exc:  # the agent frees a broken connection's pins itself
            logger.warning("kvstore release failed: %s", exc)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store host pages under their keys (a chain: each page's parent is the one before)."""
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # MLA: the writer rank stores the one shared copy
        client = self._ready()
        if client is None or not keys:
            self.stats.count(set_failed_pages=len(keys))
            return [False] * len(keys)
        started = time.perf_counter()
        results = self._save(client, keys, host_indices, extra_info)
        stored = sum(results)
        self.stats.record_set(
            stored, len(keys) - stored, stored * self._page_bytes, time.perf_counter() - started
        )
        return results

    def _save(self, client, keys, host_indices, extra_info) -> list[bool]:
        fmt, store_keys = self._format, self._store_keys(keys)
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = self._store_keys(prefix[-1:])[-1] if prefix else None
        starts = host_indices[:: fmt.page_tokens].tolist()
        reservation = None
        try:
            reservation = client.save(
                self.settings.tenant,
                store_keys,
                fmt.payload_bytes,
                first_parent=parent,
                layout_hash=fmt.layout_hash,
                codec_id=CODEC_IDS[self.settings.codec],
            )
            written, checksums = self._write(starts, store_keys, reservation.payloads)
            if written:
                committed = client.commit(reservation, keys=written, checksums=checksums)
                written = written if committed == len(written) else []  # then none is sure
            return self._pages_stored(client, store_keys, reservation.payloads, written)
        except _FAILURES as exc:
            logger.warning("kvstore save of %d pages failed: %s", len(keys), exc)
            if reservation is not None:
                self._abort(client, reservation)
            return [False] * len(keys)

    def _pages_stored(self, client, store_keys, payloads, written) -> list[bool]:
        """Per page: True when each of its blocks was written now or is held already (the
        agent reserves no page for those; nor for a block being written or with no room)."""
        held = set(written)
        unreserved = [key for key, view in zip(store_keys, payloads, strict=True) if view is None]
        if unreserved:  # the leading ones stored in this node's tiers
            found = client.lookup(self.settings.tenant, unreserved, local_only=True).total
            held.update(unreserved[:found])
        count = self._groups.count
        return [
            all(key in held for key in store_keys[start : start + count])
            for start in range(0, len(store_keys), count)
        ]

    def _write(self, starts: list[int], store_keys, payloads) -> tuple[list, list[int]]:
        """Copy every reserved block out of its host page: the keys written, their checksums."""
        count, written, checksums = self._groups.count, [], []
        for page, start in enumerate(starts):
            blocks = slice(page * count, (page + 1) * count)
            sums = copies.save_page(self._format, start, payloads[blocks])
            for key, checksum in zip(store_keys[blocks], sums, strict=True):
                if checksum is not None:
                    written.append(key)
                    checksums.append(checksum)
        return written, checksums

    def _abort(self, client: KVStoreClient, reservation) -> None:
        try:
            client.abort(reservation)
        except _FAILURES:  # a broken connection's reservations are freed by the agent
            logger.debug("kvstore abort failed", exc_info=True)

    # ---- the per-key interface SGLang still declares abstract ------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        raise NotImplementedError("the kvstore backend is zero-copy only: use batch_get_v1")

    def batch_get(self, keys, target_locations: Any = None, target_sizes: Any = None):
        raise NotImplementedError("the kvstore backend is zero-copy only: use batch_get_v1")

    def set(self, key, value: Any = None, target_location: Any = None, target_sizes: Any = None):
        raise NotImplementedError("the kvstore backend is zero-copy only: use batch_set_v1")

    def batch_set(
        self, keys, values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ):
        raise NotImplementedError("the kvstore backend is zero-copy only: use batch_set_v1")

    # ---- lifecycle and metrics -------------------------------------------------------------
    def get_stats(self):
        """SGLang's StorageMetrics of the calls since the last get_stats, plus running totals
        of hits, misses and bytes (`totals`)."""
        return self.stats.take()

    def clear(self) -> None:
        """Refused: kvstore's blocks are shared by every engine of the cluster, so one engine
        does not drop them (SGLang reports the clear failed). They age out by eviction; a new
        `salt` or `tenant` starts afresh."""
        raise NotImplementedError(
            "kvstore's blocks are shared by every engine of the cluster: one engine does not "
            "clear them (they are evicted as they age; a new salt or tenant starts afresh)"
        )

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._drop(self._client)
            self._client = None
