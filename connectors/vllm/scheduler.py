"""The scheduler half of the connector: how many prompt tokens the store can supply, and per
step which chunks each worker loads and saves. Runs in vLLM's scheduler (engine core) process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from connectors.vllm import compat
from connectors.vllm.agent import AgentConnection
from connectors.vllm.config import ConnectorSettings, EngineKV
from connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.costmodel import OnlineLoadPlanner
from kvstore.errors import KVStoreError
from kvstore.keys import chunk_keys

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    keys: list[bytes]  # keys of every full chunk of the prompt
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save (loaded or saved)
    load_chunks: int = 0
    computed_at_load: int = 0
    saves_scheduled: bool = False  # some worker may still be saving: delay the blocks' free


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV) -> None:
        self.settings = settings
        self.kv = kv
        self.agent = AgentConnection(
            settings.socket_path, "vllm-scheduler", settings.credential_file
        )
        self.requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, RequestState] = {}
        self.delay_frees = compat.saves_outlive_steps()
        self.stats = {"lookups": 0, "hit_tokens": 0, "lookup_failures": 0, "recomputed_chunks": 0}
        self.cost = OnlineLoadPlanner(kv.layout.chunk_tokens)  # load only what beats compute

    def _state(self, request) -> RequestState:
        """Per-request bookkeeping; requests whose KV is not a function of their tokens alone
        (see _not_keyed_by_tokens_alone) never get any, so they are neither loaded nor saved."""
        state = self.requests.get(request.request_id)
        if state is None:
            tokens = request.prompt_token_ids or []
            keys = chunk_keys(self.kv.namespace, tokens, self.kv.layout.chunk_tokens)
            state = self.requests[request.request_id] = RequestState(keys=list(keys))
        return state

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` loadable from the store (whole chunks, always
        leaving at least one prompt token to compute). No side effects on the store."""
        if _not_keyed_by_tokens_alone(request):
            return 0
        state = self._state(request)
        state.computed_at_load = num_computed_tokens
        chunk = self.kv.layout.chunk_tokens
        prompt_tokens = len(request.prompt_token_ids or [])
        usable = min(len(state.keys), (prompt_tokens - 1) // chunk)
        if usable * chunk <= num_computed_tokens or self.agent.client is None:
            return 0
        try:
            rank_keys = [self.kv.rank_key(key) for key in state.keys[:usable]]
            counts = self.agent.client.lookup(self.settings.tenant, rank_keys)
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed (%s); computing the prefix", exc)
            self.stats["lookup_failures"] += 1
            self.agent.drop()
            return 0
        self.stats["lookups"] += 1
        skip = num_computed_tokens // chunk  # chunks vLLM already holds: never loaded
        tiers = (["local"] * counts.local + ["remote"] * counts.remote)[skip:]
        hits = skip + self.cost.chunks_to_load(
            request.request_id, tiers, prompt_tokens - skip * chunk
        )
        self.stats["recomputed_chunks"] = self.cost.recomputed_chunks
        external = max(0, hits * chunk - num_computed_tokens)
        self.stats["hit_tokens"] += external
        return external

    def after_alloc(self, request, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._state(request)
        computed = state.computed_at_load  # what get_num_new_matched_tokens was told
        state.load_chunks = (computed + num_external_tokens) // self.kv.layout.chunk_tokens
        state.saved_chunks = state.load_chunks
        self._pending_loads[request.request_id] = state

    def build_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        steps = [(s.req_id, s.num_scheduled_tokens, s.num_computed_tokens)
                 for s in compat.scheduled_requests(scheduler_output)]  # fmt: skip
        self.cost.step_started(steps, time.perf_counter())
        for scheduled in compat.scheduled_requests(scheduler_output):
            state = self.requests.get(scheduled.req_id)
            if state is None:
                continue
            if scheduled.block_ids is not None:
                state.block_ids = scheduled.block_ids
            state.block_ids.extend(scheduled.new_block_ids)
            if scheduled.req_id in self._pending_loads:
                meta.loads.append(self._load_spec(scheduled.req_id, state))
            done = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens
            save = self._save_spec(scheduled.req_id, state, done)
            if save is not None:
                meta.saves.append(save)
        self._pending_loads.clear()
        return meta

    def _load_spec(self, req_id: str, state: RequestState) -> LoadSpec:
        return LoadSpec(
            req_id, state.keys[: state.load_chunks], list(state.block_ids),
            state.computed_at_load // self.kv.block_size,
        )  # fmt: skip

    def _save_spec(self, req_id: str, state: RequestState, done_tokens: int) -> SaveSpec | None:
        complete = min(len(state.keys), done_tokens // self.kv.layout.chunk_tokens)
        first, per_chunk = state.saved_chunks, self.kv.blocks_per_chunk
        if complete <= first or len(state.block_ids) < complete * per_chunk:
            return None
        state.saved_chunks = complete
        state.saves_scheduled = True
        return SaveSpec(
            req_id, state.keys[first:complete], state.keys[first - 1] if first else b"",
            state.block_ids[first * per_chunk : complete * per_chunk],
        )  # fmt: skip

    def finished(self, request) -> bool:
        """Forget the request; True when its blocks must outlive it until the workers report
        its saves committed (vLLM's delayed free, through get_finished)."""
        state = self.requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self.cost.step_ended(time.perf_counter())
        self.cost.forget(request.request_id)
        return self.delay_frees and state is not None and state.saves_scheduled


def _not_keyed_by_tokens_alone(request) -> bool:
    """LoRA adapters, multimodal inputs and cache salts change the KV of the same tokens; the
    chunk keys do not cover them yet, so such requests bypass the store."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
    )
