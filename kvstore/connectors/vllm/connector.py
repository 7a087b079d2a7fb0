"""KVStoreConnector: vLLM's KVConnectorBase_V1 backed by kvstore. vLLM builds it twice, once in
the scheduler (role SCHEDULER) and once in each worker (role WORKER); each instance does only
its own half, delegating to SchedulerSide or WorkerSide.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kvstore.connectors.vllm import compat, events
from kvstore.connectors.vllm.compat import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from kvstore.connectors.vllm.config import ConnectorSettings, engine_kv
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.stats import (
    DeltaCounters,
    KVStoreConnectorStats,
    KVStorePromMetrics,
    LatencySamples,
)
from kvstore.connectors.vllm.worker import WorkerSide

logger = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        # Refuses (ConfigError) what it cannot store correctly: Mamba state, MLA, ...
        groups = compat.cache_groups(kv_cache_config, vllm_config.cache_config.block_size)
        self.kv = engine_kv(vllm_config, self.settings)
        is_scheduler, is_worker = role == KVConnectorRole.SCHEDULER, role == KVConnectorRole.WORKER
        self.scheduler = SchedulerSide(self.settings, self.kv, groups) if is_scheduler else None
        self.worker = WorkerSide(self.settings, self.kv, groups) if is_worker else None
        # KV events (--kv-events-config): the scheduler announces what the workers committed
        self.events = (
            events.scheduler_tracker(vllm_config, kv_cache_config, self.settings, self.kv)
            if is_scheduler
            else None
        )
        if self.worker is not None and events.worker_collects(vllm_config):
            self.worker.saves.committed = []
        self._deltas = DeltaCounters()  # this half's counters, reported to vLLM's stat loggers
        self._samples = self.scheduler.samples if self.scheduler else LatencySamples()
        self._load_wait_s: float | None = None  # this step's waits for layer loads
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "set kv_load_failure_policy='recompute': with 'fail', a kvstore miss "
                "found at load time (evicted, corrupt, agent gone) fails the request"
            )
        logger.info(
            "kvstore connector (%s): %s, namespace %s",
            role.name,
            self.kv.layout.layout_id,
            self.kv.namespace.model_fingerprint,
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads wait and saves copy per layer, inside the forward: a full CUDA graph would
        skip them on replay, so vLLM must capture piecewise."""
        return True

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """(tokens, False): loads are synchronous (layer-wise, in the forward), or
        (tokens, True) for a model of several KV cache groups, whose loads vLLM must be able
        to fail per request (CacheGroups.loads_asynchronously); (None, False) while the
        lookup is in flight: vLLM asks again on a later step."""
        started = time.perf_counter()
        if self.events is not None:
            self.events.seen(request)
        tokens = self.scheduler.matched_tokens(request, num_computed_tokens)
        self.scheduler.note_match_s(time.perf_counter() - started)
        return tokens, bool(tokens) and self.scheduler.groups.loads_asynchronously

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        shares = self.scheduler.hit_sources(request, num_external_tokens)
        return compat.hit_sources(shares)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        meta = self.scheduler.build_meta(scheduler_output)
        if self.events is not None:
            self.events.node_id = self.scheduler.agent.node_id
            self.events.scheduled(meta.saves, self.scheduler.requests)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A request that had saves keeps its blocks until every worker committed them.
        return self._finished(request), None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        """The hybrid KV cache manager's request_finished (every group's blocks at once)."""
        return self._finished(request), None

    def _finished(self, request) -> bool:
        if self.events is not None:
            self.events.forget(request.request_id)
        return self.scheduler.finished(request)

    def update_connector_output(self, connector_output) -> None:
        """The workers' reports of a step: failed asynchronous loads, the chunks they
        committed (KV events)."""
        self.scheduler.loads_failed(connector_output.failed_recving or ())
        if self.events is not None:
            self.events.committed(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[Any]:
        """vLLM's BlockStored / BlockRemoved for this host's kvstore blocks (events.py)."""
        return self.events.take() if self.events is not None else ()

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self.worker.start_load(meta)
        if meta.loads:
            self._load_wait_s = 0.0

    def wait_for_layer_load(self, layer_name: str) -> None:
        started = time.perf_counter()
        self.worker.wait_for_layer(layer_name)
        if self._load_wait_s is not None:
            self._load_wait_s += time.perf_counter() - started

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        started = time.perf_counter()
        self.worker.finish_load()
        if self._load_wait_s is not None:
            self._samples.add(
                "load_wait_seconds", self._load_wait_s + time.perf_counter() - started
            )
            self._samples.add("load_fetch_seconds", self.worker.fetch_s)
            self._load_wait_s = None
        started = time.perf_counter()
        self.worker.finish_save()
        if self.has_connector_metadata() and self._get_connector_metadata().saves:
            self._samples.add("save_seconds", time.perf_counter() - started)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.KVConnectorTransferResults:
        """Requests whose saves are committed (their blocks may be freed), and asynchronous
        loads finished, the failed ones among them (recomputed from their first token)."""
        finished, failed = self.worker.take_finished_loads()
        saved = self.worker.finished_saving(finished_req_ids)
        return compat.KVConnectorTransferResults(saved, finished, failed)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Called before every forward: saves still running finish first only where they
        may read blocks vLLM handed to other requests (KVStoreConnectorMetadata.flush_saves);
        otherwise they go on under this step's forward."""
        if kv_connector_metadata.flush_saves:
            self.worker.commit_all()
            self.worker.saves.forget(kv_connector_metadata.preempted)

    def get_kv_connector_kv_cache_events(self) -> events.CommittedChunks | None:
        """The chunks this worker committed this step, for the scheduler's KV events."""
        committed = self.worker.saves.committed if self.worker is not None else None
        if not committed:
            return None
        self.worker.saves.committed = []
        return events.CommittedChunks(committed)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache (a dropped save is a later miss), whose handle_preemptions
        commits every save before a preempted request's blocks are reused: vLLM need not
        recompute a request preempted with saves pending."""
        return False

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_block_ids() if self.worker else set()

    # ---- vLLM's metrics (both halves) -------------------------------------------------------
    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """This half's counter increments and latency samples since the last call."""
        half = self.scheduler or self.worker
        cumulative = dict(half.stats)
        if self.scheduler is not None:
            cumulative.update({f"bypassed_{r}": n for r, n in self.scheduler.bypassed.items()})
        stats = KVStoreConnectorStats()
        stats.add(self._deltas.take(cumulative), self._samples.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.lookups.close()
            self.scheduler.probes.close()
            self.scheduler.agent.drop()
            self.scheduler.stage_agents.drop()
        if self.events is not None:
            self.events.close()
        if self.worker is not None:
            self.worker.close()
