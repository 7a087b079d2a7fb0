"""The scheduler half of the connector: how many prompt tokens the store can supply (and from
which tier), and per step which chunks each worker loads and saves. Runs in vLLM's scheduler
(engine core) process; lookups run on its lookup thread, and the promotion of disk chunks into
the host arena and the pull of other hosts' chunks into it on its staging threads (see
lookups.py), so a forward pass copies from the arena only; tiers are timed on its probe thread
(probes.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from kvstore.client import TIERS, LookupCounts
from kvstore.connectors.vllm import compat
from kvstore.connectors.vllm.agent import AgentConnection, ThreadConnections
from kvstore.connectors.vllm.config import ConnectorSettings, EngineKV
from kvstore.connectors.vllm.lookups import LookupQueue, chunk_tiers, tokens_by_tier
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.probes import TierProbes
from kvstore.connectors.vllm.request_keys import RequestKeys
from kvstore.connectors.vllm.stats import LatencySamples
from kvstore.connectors.vllm.tails import (
    covered_tokens,
    loadable_tokens,
    prompt_tail,
    stored_tokens,
    tail_candidates,
)
from kvstore.costmodel import OnlineLoadPlanner
from kvstore.tier import BY_CODE

logger = logging.getLogger(__name__)
_CODE_OF_TIER = {answer.name: code for code, answer in BY_CODE.items()}


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
    token_ids: list[int] = field(default_factory=list)  # the prompt's (for its tail, tails.py)
    root: bytes | None = None  # what its first chunk chains on (RequestKeys.root)
    found_tail: tuple[bytes, int] = (b"", 0)  # the last lookup's tail: (key, engine blocks)
    load_tail: tuple[bytes, int] = (b"", 0)  # the tail to load after load_chunks
    tail_saved: bool = False  # the prompt's tail is stored (loaded, saved, or none to save)


@dataclass
class PrefixFound:
    """A lookup's answer: the leading whole chunks by tier, then the tail found after them."""

    chunks: LookupCounts
    tail_key: bytes = b""
    tail_blocks: int = 0
    tail_tier: str = ""

    def tier_names(self) -> list[str]:
        """Where each whole chunk, then the tail, was found."""
        return [*self.chunks.tier_names(), *([self.tail_tier] if self.tail_blocks else [])]


NOTHING_FOUND = PrefixFound(LookupCounts(0, 0))


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
        self.stats = {
            "lookups": 0,
            "hit_tokens": 0,
            "lookup_failures": 0,
            "lookups_deferred": 0,
            "prefetched_blocks": 0,
            "promoted_blocks": 0,
            "recomputed_chunks": 0,
            "saves_out_of_window": 0,
            "saved_tails": 0,
            "loaded_tails": 0,
            "hit_prompt_tokens": 0,
        }
        self.stats.update({f"hit_tokens_{tier}": 0 for tier in TIERS})
        self.lookups = LookupQueue(self._lookup, settings.stage_threads)
        # load only what beats compute; the arena is read in place, always worth loading
        self.cost = OnlineLoadPlanner(kv.layout.chunk_tokens, free_tiers=frozenset({"host"}))
        probing = AgentConnection(settings, "vllm-scheduler-probe", pin_mapping=False)
        self.probes = TierProbes(probing, settings.tenant, self.cost)
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
            state = RequestState(
                keys=keys,
                block_ids=[[] for _ in self.groups.windows],
                token_ids=request.prompt_token_ids,
                root=self.request_keys.root(request),
            )
            self.requests[request.request_id] = state
        return state

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` loadable from the store (whole chunks, then the
        tail's blocks: all but the last prompt token at most, tails.loadable_tokens); None
        while the lookup is in flight (vLLM asks again on a later step). No side effects on
        the store."""
        state = self._state(request)
        if state is None or state.load_failed:
            return 0
        state.computed_at_load = num_computed_tokens
        chunk = self.kv.layout.chunk_tokens
        prompt_tokens = state.prompt_tokens = len(request.prompt_token_ids or [])
        usable = min(len(state.keys), stored_tokens(prompt_tokens, self.kv.block_size) // chunk)
        if loadable_tokens(prompt_tokens, self.kv.block_size) <= num_computed_tokens:
            return 0
        answer = self.lookups.answer(request.request_id, state.keys[:usable])
        if answer is None:
            self.stats["lookups_deferred"] += 1
            return None
        if not answer.counted:
            answer.counted = True
            self._count(answer)
        found = answer.counts
        if found is None:
            return 0
        state.hit_tiers = found.tier_names()
        state.found_tail = (found.tail_key, found.tail_blocks)
        tokens = found.chunks.total * chunk + found.tail_blocks * self.kv.block_size
        tokens = min(tokens, loadable_tokens(prompt_tokens, self.kv.block_size))
        return max(0, tokens - num_computed_tokens)

    def note_match_s(self, seconds: float) -> None:
        """How long vLLM's scheduler waited in one get_num_new_matched_tokens call."""
        self.samples.add("match_seconds", seconds)
        self.longest_match_s = max(self.longest_match_s, seconds)

    def _lookup(self, req_id: str, chain_keys: list[bytes]):
        """On the lookup thread: the chunks to load as LookupCounts (their codes say where each
        was found) when all are in this host's arena; otherwise the staging that brings them
        there (a callable, run on a staging thread, returning those LookupCounts)."""
        plan = functools.partial(self._plan_loads, req_id, chain_keys)
        return self.agent.call(plan, otherwise=NOTHING_FOUND)  # no agent: nothing to load

    def _plan_loads(self, req_id: str, chain_keys: list[bytes], client):
        groups = self.kv.lookup_blocks_per_chunk  # every rank's groups of every PP stage
        block_keys = self.kv.lookup_keys(chain_keys)  # chunk-major
        tokens = max(1, self.kv.layout.chunk_tokens // groups)  # each key's share of its chunk
        answer = client.lookup(self.settings.tenant, block_keys, chunk_tokens=tokens)
        found = chunk_tiers(answer, groups)
        tiers = found[: self._chunks_worth_loading(req_id, found)]
        self._probe_computed(req_id, found, len(tiers), block_keys)
        block_keys = block_keys[: len(tiers) * groups]
        whole = len(tiers)
        tail = self._tail(req_id, client, whole) if tiers == found else None
        if tail is not None and tail[2] not in self.cost.free_tiers and tail[2] not in tiers:
            tail = None  # its tier is not one loading was predicted faster from: computed
        if tail is not None:  # staged as one more chunk: its blocks after the whole chunks'
            block_keys += self.kv.lookup_keys([tail[0]])
            tiers = [*tiers, tail[2]]
        if set(tiers) <= {"host"}:
            return self._found(self._stage(client, block_keys, tiers, groups), whole, tail)
        return functools.partial(self._stage_apart, block_keys, tiers, groups, whole, tail)

    def _probe_computed(
        self, req_id: str, found: list[str], loaded: int, block_keys: list[bytes]
    ) -> None:
        """Probe (in the background) each tier of the chunks computed after the `loaded`
        ones: a slow tier is timed again (at most once per probes.interval_s), so it is loaded
        from again once it recovers, without a live request paying for finding out."""
        for tier in dict.fromkeys(found[loaded:]):
            if tier not in self.cost.free_tiers:
                self._probe_chunk(req_id, found, block_keys, found.index(tier, loaded))

    def _probe_chunk(self, req_id: str, found: list[str], block_keys: list[bytes], index: int):
        """Probe chunk `index` of the request's lookup (in tier `found[index]`; block keys
        chunk-major). A started probe stores that chunk here (promoted, pulled), so the
        request does not save it, nor the stored ones before it: its own save of the same
        key, were it first, would be what the probe reads, pricing a far tier at the arena's
        speed."""
        groups = self.kv.lookup_blocks_per_chunk
        keys = block_keys[index * groups : (index + 1) * groups]
        state = self.requests.get(req_id)
        if self.probes.probe(found[index], keys) is not None and state is not None:
            state.saved_chunks = max(state.saved_chunks, index + 1)

    def _tail(self, req_id: str, client, chunks: int) -> tuple[bytes, int, str] | None:
        """On the lookup thread: (key, engine blocks, tier) of the longest stored tail after
        the first `chunks` whole chunks (tails.py), or None."""
        state = self.requests.get(req_id)
        if state is None:
            return None
        groups = self.kv.lookup_blocks_per_chunk
        candidates = tail_candidates(
            state.token_ids,
            state.keys,
            state.root,
            chunks,
            self.kv.layout.chunk_tokens,
            self.kv.block_size,
        )
        for key, blocks in candidates:
            answer = client.lookup(self.settings.tenant, self.kv.lookup_keys([key]))
            tiers = chunk_tiers(answer, groups)
            if tiers:
                return key, blocks, tiers[0]
        return None

    @staticmethod
    def _found(staged: LookupCounts, whole: int, tail) -> PrefixFound:
        """What staging brought into the arena, of `whole` chunks then `tail` (key, engine
        blocks, tier; or None): the chunks that came, and the tail if it came too."""
        chunks = min(staged.total, whole)
        local = min(staged.local, chunks)
        counts = LookupCounts(local, chunks - local, staged.codes[:chunks])
        if tail is None or staged.total <= whole:
            return PrefixFound(counts)
        return PrefixFound(counts, *tail)

    def _stage_apart(self, block_keys, tiers: list[str], groups: int, whole: int, tail):
        """On a staging thread, over that thread's own connection (see _stage)."""
        stage = functools.partial(self._stage, block_keys=block_keys, tiers=tiers, groups=groups)
        staged = self.stage_agents.connection.call(stage, otherwise=LookupCounts(0, 0))
        return self._found(staged, whole, tail)

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
        )
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

    def _pull(
        self, client, block_keys: list[bytes], tiers: list[str], groups: int, tier: str
    ) -> int:
        """Pin and release `block_keys` (the agent promotes or fetches what is not in its
        arena); the chunks that arrived, their `tier` ones' time observed by the cost model."""
        started = time.perf_counter()
        loaded = client.load(
            self.settings.tenant, block_keys, verify=False, timeout_s=self.settings.load_timeout_s
        )
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
        covered = covered_tokens(computed + num_external_tokens, self.kv.block_size)
        state.load_chunks, rest = divmod(covered, self.kv.layout.chunk_tokens)
        # vLLM takes what it was offered, or (rarely) less: a tail only if all of it fits
        whole_tail = rest == state.found_tail[1] * self.kv.block_size
        state.load_tail = state.found_tail if whole_tail else (b"", 0)
        state.tail_saved |= bool(state.load_tail[1])  # loaded: stored already
        self.stats["loaded_tails"] += bool(state.load_tail[1])
        self.stats["hit_prompt_tokens"] += state.prompt_tokens
        state.saved_chunks = max(state.saved_chunks, state.load_chunks)  # probed: _probe_chunk
        self._pending_loads[request.request_id] = state

    def hit_sources(self, request, num_external_tokens: int) -> dict[str, int]:
        """The tokens the last lookup offered, by the tier each chunk was found in ('host',
        'disk': this host's; 'remote': another's); only non-zero shares."""
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        return tokens_by_tier(
            state.hit_tiers,
            self.kv.layout.chunk_tokens,
            state.computed_at_load,
            num_external_tokens,
        )

    def build_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        self.lookups.new_step()
        meta = self._flush_for(compat.preempted_req_ids(scheduler_output))
        steps = [
            (s.req_id, s.num_scheduled_tokens, s.num_computed_tokens)
            for s in compat.scheduled_requests(scheduler_output)
        ]
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
            tail = self._tail_save_spec(
                scheduled.req_id, state, done, scheduled.num_computed_tokens
            )
            if tail is not None:
                meta.saves.append(tail)
        # synchronous loads are of requests scheduled now; asynchronous ones wait for theirs
        meta.loads = [
            self._load_spec(req_id, state) for req_id, state in self._pending_loads.items()
        ]
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
            req_id,
            state.keys[: state.load_chunks],
            [list(ids) for ids in state.block_ids],
            state.computed_at_load // self.kv.block_size,
            self.groups.loads_asynchronously,
            *state.load_tail,
        )

    def loads_failed(self, req_ids) -> None:
        """The workers' failed asynchronous loads: vLLM computes those requests from their
        first token, so they are not loaded again, and every chunk they compute is saved."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.load_failed, state.load_chunks, state.saved_chunks = True, 0, 0
                state.load_tail, state.tail_saved = (b"", 0), False

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
            state.tail_saved = True  # nor would the tail
            self.stats["saves_out_of_window"] += 1
            return None
        state.saved_chunks = complete
        state.saves_scheduled = True
        return SaveSpec(
            req_id,
            state.keys[first:complete],
            state.keys[first - 1] if first else b"",
            blocks,
        )

    def _tail_save_spec(
        self, req_id: str, state: RequestState, done_tokens: int, step_start_tokens: int
    ) -> SaveSpec | None:
        """The prompt's tail (tails.py), once the prompt is computed and every whole chunk
        before it saved (or loaded); at most once per request."""
        if state.tail_saved or done_tokens < state.prompt_tokens or not state.prompt_tokens:
            return None
        tail = prompt_tail(
            state.token_ids, state.keys, state.root, self.kv.layout.chunk_tokens, self.kv.block_size
        )
        state.tail_saved = True
        if tail is None:
            return None
        key, chunks, blocks = tail
        first = chunks * self.kv.blocks_per_chunk
        ids = [ids[first : first + blocks] for ids in state.block_ids]
        if state.saved_chunks < chunks or any(len(group) < blocks for group in ids):
            return None  # its parent chain is not stored, or its blocks are gone
        if not self._in_window(chunks, step_start_tokens, ids):
            return None
        state.saves_scheduled = True
        self.stats["saved_tails"] += 1
        parent = state.keys[chunks - 1] if chunks else b""
        return SaveSpec(req_id, [key], parent, ids, tail_blocks=blocks)

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
