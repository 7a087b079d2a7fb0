"""KVStoreConnector: vLLM's KVConnectorBase_V1 backed by kvstore. vLLM builds it twice, once in
the scheduler (role SCHEDULER) and once in each worker (role WORKER); each instance does only
its own half, delegating to SchedulerSide or WorkerSide.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from connectors.vllm.compat import KVConnectorBase_V1, KVConnectorRole
from connectors.vllm.config import ConnectorSettings, engine_kv
from connectors.vllm.metadata import KVStoreConnectorMetadata
from connectors.vllm.scheduler import SchedulerSide
from connectors.vllm.worker import WorkerSide

logger = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        self.kv = engine_kv(vllm_config, self.settings)
        self.scheduler = (
            SchedulerSide(self.settings, self.kv) if role == KVConnectorRole.SCHEDULER else None
        )
        self.worker = WorkerSide(self.settings, self.kv) if role == KVConnectorRole.WORKER else None
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "set kv_load_failure_policy='recompute': with 'fail', a kvstore miss "
                "found at load time (evicted, corrupt, agent gone) fails the request"
            )
        logger.info("kvstore connector (%s): %s, namespace %s", role.name, self.kv.layout.layout_id,
                    self.kv.namespace.model_fingerprint)  # fmt: skip

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads wait and saves copy per layer, inside the forward: a full CUDA graph would
        skip them on replay, so vLLM must capture piecewise."""
        return True

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A request that had saves keeps its blocks until every worker committed them.
        return self.scheduler.finished(request), None

    def take_events(self) -> Iterable[Any]:
        return ()

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.worker.finish_load()
        self.worker.finish_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished_saving(finished_req_ids) or None, None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self.worker.commit_all()  # a preempted request's blocks may be reused next

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_block_ids() if self.worker else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
