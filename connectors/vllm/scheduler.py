"""The scheduler half of the connector: how many prompt tokens the store can supply (and from
which tier), and per step which chunks each worker loads and saves. Runs in vLLM's scheduler
(engine core) process; lookups run on its lookup thread, and the promotion of disk chunks into
the host arena and the pull of other hosts' chunks into it on its staging threads (see
lookups.py), so a forward pass copies from the arena only.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from connectors.vllm import compat
from connectors.vllm.agent import AgentConnection, ThreadConnections
from connectors.vllm.config import ConnectorSettings, EngineKV
from connectors.vllm.lookups import LookupQueue, chunk_tiers, tokens_by_tier
from connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from connectors.vllm.request_keys import RequestKeys
from connectors.vllm.stats import LatencySamples
from kvstore.client import TIER_OF_CODE, TIERS, LookupCounts
from kvstore.costmodel import OnlineLoadPlanner

logger = logging.getLogger(__name__)
_CODE_OF_TIER = {tier: code for code, tier in TIER_OF_CODE.items()}


@dataclass
class RequestState:
    keys: list[bytes]  # keys of every full chunk of the prompt
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save (loaded or saved)
    load_chunks: int = 0
    computed_at_load: int = 0
    prompt_tokens: int = 0
    hit_tiers: list[str] = field(default_factory=list)  # of the last lookup: tier per chunk
    saves_scheduled: bool = False  # some worker may still be saving: delay the blocks' free
    load_failed: bool = False  # an asynchronous load failed: vLLM recomputes it, unloaded


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        kv: EngineKV,
        groups: compat.CacheGroups = compat.ONE_GROUP,
    ) -> None:
        self.settings = settings
        self.kv = kv
        self.groups = groups
        # the lookup thread's connection, and each staging thread's own; none copies payloads
        self.agent = AgentConnection(settings, "vllm-scheduler", pin_mapping=False)
        self.stage_agents = ThreadConnections(
            lambda: AgentConnection(settings, "vllm-scheduler-stage", pin_mapping=False)
        )
        self._staged_lock = threading.Lock()  # the staging threads' counters and cost samples
        self.requests: dict[str, RequestState] = {}
        self._pending_loads: dict[str, RequestState] = {}
        self._bypassing: set[str] = set()  # ids of live requests the store bypasses
        self.delay_frees = compat.saves_outlive_steps()
        self.request_keys = RequestKeys(kv)
        self.stats = {"lookups": 0, "hit_tokens": 0, "lookup_failures": 0, "lookups_deferred": 0,
                      "prefetched_blocks": 0, "promoted_blocks": 0, "recomputed_chunks": 0,
                      "saves_out_of_window": 0}  # fmt: skip
        self.stats.update({f"hit_tokens_{tier}": 0 for tier in TIERS})
        self.lookups = LookupQueue(self._lookup, settings.stage_threads)
        # load only what beats compute; the arena is read in place, always worth loading
        self.cost = OnlineLoadPlanner(kv.layout.chunk_tokens, free_tiers=frozenset({"host"}))
        self.bypassed: dict[str, int] = {}  # reason -> requests (see RequestKeys.bypass_reason)
        self.samples = LatencySamples()
        self.longest_match_s = 0.0

    def _state(self, request) -> RequestState | None:
        """Per-request bookkeeping, made on first sight; None (counted once) for a request the
        store must bypass, which then is neither loaded nor saved."""
        state = self.requests.get(request.request_id)
        if state is None and request.request_id not in self._bypassing:
            reason = self.request_keys.bypass_reason(request)
            if reason is not None:
                self._bypassing.add(request.request_id)
                self.bypassed[reason] = self.bypassed.get(reason, 0) + 1
                return None
            keys = self.request_keys.keys(request)
            state = RequestState(keys=keys, block_ids=[[] for _ in self.groups.windows])
            self.requests[request.request_id] = state
        return state

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` loadable from the store (whole chunks, always
        leaving at least one prompt token to compute); None while the lookup is in flight (vLLM
        asks again on a later step). No side effects on the store."""
        state = self._state(request)
        if state is None or state.load_failed:
            return 0
        state.computed_at_load = num_computed_tokens
        chunk = self.kv.layout.chunk_tokens
        prompt_tokens = state.prompt_tokens = len(request.prompt_token_ids or [])
        usable = min(len(state.keys), (prompt_tokens - 1) // chunk)
        if usable * chunk <= num_computed_tokens:
            return 0
        answer = self.lookups.answer(request.request_id, state.keys[:usable])
        if answer is None:
            self.stats["lookups_deferred"] += 1
            return None
        if not answer.counted:
            answer.counted = True
            self._count(answer)
        if answer.counts is None:
            return 0
        state.hit_tiers = list(answer.counts.tier_names())
        return max(0, answer.counts.total * chunk - num_computed_tokens)

    def note_match_s(self, seconds: float) -> None:
        """How long vLLM's scheduler waited in one get_num_new_matched_tokens call."""
        self.samples.add("match_seconds", seconds)
        self.longest_match_s = max(self.longest_match_s, seconds)

    def _lookup(self, req_id: str, chain_keys: list[bytes]):
        """On the lookup thread: the chunks to load as LookupCounts (their codes say where each
        was found) when all are in this host's arena; otherwise the staging that brings them
        there (a callable, run on a staging thread, returning those LookupCounts)."""
        plan = functools.partial(self._plan_loads, req_id, chain_keys)
        return self.agent.call(plan, otherwise=LookupCounts(0, 0))  # no agent: nothing to load

    def _plan_loads(self, req_id: str, chain_keys: list[bytes], client):
        groups = self.kv.lookup_blocks_per_chunk  # every rank's groups of every PP stage
        block_keys = self.kv.lookup_keys(chain_keys)  # chunk-major
        tiers = chunk_tiers(client.lookup(self.settings.tenant, block_keys), groups)
        tiers = tiers[: self._chunks_worth_loading(req_id, tiers)]
        if set(tiers) <= {"host"}:
            return self._stage(client, block_keys, tiers, groups)  # nothing to bring
        return functools.partial(self._stage_apart, block_keys, tiers, groups)

    def _stage_apart(self, block_keys: list[bytes], tiers: list[str], groups: int):
        """On a staging thread, over that thread's own connection (see _stage)."""
        stage = functools.partial(self._stage, block_keys=block_keys, tiers=tiers, groups=groups)
        return self.stage_agents.connection.call(stage, otherwise=LookupCounts(0, 0))

    def _chunks_worth_loading(self, req_id: str, tiers: list[str]) -> int:
        """On the lookup thread: the leading cached chunks (`tiers[i]`: where chunk i is)
        predicted faster to load than to compute (kvstore.costmodel), decided before any is
        promoted from disk or pulled from another host; the rest are computed and counted in
        recomputed_chunks."""
        state = self.requests.get(req_id)
        if state is None:
            return 0
        chunk = self.kv.layout.chunk_tokens
        skip = min(state.computed_at_load // chunk, len(tiers))  # vLLM holds them already
        load = self.cost.chunks_to_load(
            req_id, tiers[skip:], state.prompt_tokens - skip * chunk, loaded_from="host"
        )  # fmt: skip
        self.stats["recomputed_chunks"] = self.cost.recomputed_chunks
        return skip + load

    def _stage(self, client, block_keys: list[bytes], tiers: list[str], groups: int):
        """On a staging thread (on the lookup thread when every chunk is in the arena already):
        bring the chunks to load into this host's arena now, while
        vLLM is told to ask again: disk chunks promoted, then other hosts' chunks pulled, so
        the forward pass copies from the arena only (no disk read and no remote fetch runs
        inside it); the time each took teaches the cost model its tier. What arrived is the
        answer; a chunk evicted again before the workers load it is a load error, recomputed."""
        local = tiers.index("remote") if "remote" in tiers else len(tiers)
        got = local
        if "disk" in tiers[:local]:
            got = self._pull(client, block_keys[: local * groups], tiers[:local], groups, "disk")
        if got == local < len(tiers):
            got = self._pull(client, block_keys[: len(tiers) * groups], tiers, groups, "remote")
        codes = "".join(_CODE_OF_TIER[tier] for tier in tiers[:got])
        return LookupCounts(min(local, got), max(0, got - local), codes)

    def _pull(self, client, block_keys: list[bytes], tiers: list[str], groups: int,
              tier: str) -> int:  # fmt: skip
        """Pin and release `block_keys` (the agent promotes or fetches what is not in its
        arena); the chunks that arrived, their `tier` ones' time observed by the cost model."""
        started = time.perf_counter()
        loaded = client.load(self.settings.tenant, block_keys, verify=False,
                             timeout_s=self.settings.load_timeout_s)  # fmt: skip
        client.release(loaded)
        got = min(len(loaded.payloads) // groups, len(tiers))
        arrived = tiers[:got].count(tier)
        counter = "promoted_blocks" if tier == "disk" else "prefetched_blocks"
        with self._staged_lock:  # several staging threads count into one dict
            self.cost.observe_fetch(tier, arrived, time.perf_counter() - started)
            self.stats[counter] += arrived * groups
        return got

    def _count(self, answer) -> None:
        if answer.counts is None:
            logger.warning("kvstore lookup failed (%s); computing the prefix", answer.error)
            self.stats["lookup_failures"] += 1
            return
        self.stats["lookups"] += 1
        self.samples.add("lookup_seconds", answer.lookup_s)

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._state(request)
        if self.groups.loads_asynchronously:  # not scheduled this step: its blocks are here
            state.block_ids = compat.allocated_block_ids(blocks)
        computed = state.computed_at_load  # what get_num_new_matched_tokens was told
        self.stats["hit_tokens"] += num_external_tokens
        for tier, tokens in self.hit_sources(request, num_external_tokens).items():
            self.stats[f"hit_tokens_{tier}"] += tokens
        state.load_chunks = (computed + num_external_tokens) // self.kv.layout.chunk_tokens
        state.saved_chunks = state.load_chunks
        self._pending_loads[request.request_id] = state

    def hit_sources(self, request, num_external_tokens: int) -> dict[str, int]:
        """The tokens the last lookup offered, by the tier each chunk was found in ('host',
        'disk': this host's; 'remote': another's); only non-zero shares."""
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        return tokens_by_tier(state.hit_tiers, self.kv.layout.chunk_tokens,
                              state.computed_at_load, num_external_tokens)  # fmt: skip

    def build_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        self.lookups.new_step()
        meta = self._flush_for(compat.preempted_req_ids(scheduler_output))
        steps = [(s.req_id, s.num_scheduled_tokens, s.num_computed_tokens)
                 for s in compat.scheduled_requests(scheduler_output)]  # fmt: skip
        self.cost.step_started(steps, time.perf_counter())
        for scheduled in compat.scheduled_requests(scheduler_output):
            state = self.requests.get(scheduled.req_id)
            if state is None:
                continue
            if scheduled.block_ids is not None:
                state.block_ids = scheduled.block_ids
            for group, new_ids in enumerate(scheduled.new_block_ids):
                state.block_ids[group].extend(new_ids)
            done = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens
            save = self._save_spec(scheduled.req_id, state, done, scheduled.num_computed_tokens)
            if save is not None:
                meta.saves.append(save)
        # synchronous loads are of requests scheduled now; asynchronous ones wait for theirs
        meta.loads = [self._load_spec(req_id, state)
                      for req_id, state in self._pending_loads.items()]  # fmt: skip
        self._pending_loads.clear()
        return meta

    def _flush_for(self, preempted: set[str]) -> KVStoreConnectorMetadata:
        """A step's metadata, asking the workers to finish their saves first where those that
        outlive their step (CUDA) may read blocks vLLM freed since: any preemption (the
        request may have been aborted since, its state gone; a finished one's blocks wait for
        get_finished; with a sliding window, saves complete within their step: saves.py).
        The saves are then done: the preempted requests owe no delayed free."""
        if not (self.delay_frees and preempted):
            return KVStoreConnectorMetadata()
        for req_id in preempted & self.requests.keys():
            self.requests[req_id].saves_scheduled = False
        return KVStoreConnectorMetadata(preempted=set(preempted))

    def _load_spec(self, req_id: str, state: RequestState) -> LoadSpec:
        return LoadSpec(
            req_id, state.keys[: state.load_chunks], [list(ids) for ids in state.block_ids],
            state.computed_at_load // self.kv.block_size, self.groups.loads_asynchronously,
        )  # fmt: skip

    def loads_failed(self, req_ids) -> None:
        """The workers' failed asynchronous loads: vLLM computes those requests from their
        first token, so they are not loaded again, and every chunk they compute is saved."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.load_failed, state.load_chunks, state.saved_chunks = True, 0, 0

    def _save_spec(
        self, req_id: str, state: RequestState, done_tokens: int, step_start_tokens: int
    ) -> SaveSpec | None:
        complete = min(len(state.keys), done_tokens // self.kv.layout.chunk_tokens)
        first, per_chunk = state.saved_chunks, self.kv.blocks_per_chunk
        if complete <= first or any(len(ids) < complete * per_chunk for ids in state.block_ids):
            return None
        blocks = [ids[first * per_chunk : complete * per_chunk] for ids in state.block_ids]
        if not self._in_window(first, step_start_tokens, blocks):
            state.saved_chunks = len(state.keys)  # later chunks would have no stored parent
            self.stats["saves_out_of_window"] += 1
            return None
        state.saved_chunks = complete
        state.saves_scheduled = True
        return SaveSpec(
            req_id, state.keys[first:complete], state.keys[first - 1] if first else b"",
            blocks,
        )  # fmt: skip

    def _in_window(self, first_chunk: int, step_start_tokens: int, blocks) -> bool:
        """Whether every sliding-window group still holds the chunks' blocks in this step's
        forward: scheduling the step, vLLM frees (and may hand to another request in the same
        step) the first (computed - window + 1) // block_size blocks (fewer with tokens in
        flight or retained), replacing them with its null block. A chunk of which some
        layer's KV is gone is never saved."""
        first_block = first_chunk * self.kv.blocks_per_chunk
        for window, ids in zip(self.groups.windows, blocks, strict=True):
            if compat.NULL_BLOCK_ID in ids:
                return False
            freed = max(0, step_start_tokens - window + 1) // self.kv.block_size if window else 0
            if first_block < freed:
                return False
        return True

    def finished(self, request) -> bool:
        """Forget the request; True when its blocks must outlive it until the workers report
        its saves committed (vLLM's delayed free, through get_finished)."""
        state = self.requests.pop(request.request_id, None)
        self._bypassing.discard(request.request_id)
        self.lookups.discard(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        self.cost.step_ended(time.perf_counter())
        self.cost.forget(request.request_id)
        return self.delay_frees and state is not None and state.saves_scheduled
