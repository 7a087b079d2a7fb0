"""The worker half's saves: each layer's newly completed chunks are copied into reserved arena
pages right after its attention runs (on CUDA, on the copy engine's stream after an event on
the compute stream), hashed once (as they are written on the CPU; on CUDA by the copy engine's
verifier thread once each DMA completes, kvcopy/streams.py), and committed with those
checksums once the copies and hashes are done: at the end of the step on the CPU; on CUDA
when the step's StepDone completes, off the forward's critical path (the forward only asks,
never waits, and the agent has nothing to hash), while vLLM's delayed free (request_finished
→ True, released through get_finished) keeps the source blocks alive. The pages are asked for
as the step starts, before its loads, so their answer comes with the loads' (one round trip);
a reservation that got no page (every chunk stored already) is dropped without waiting. Runs
in each vLLM worker process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.client import SaveReservation
from kvstore.codec import CODEC_IDS
from kvstore.connectors.vllm import compat
from kvstore.connectors.vllm.agent import AgentConnection
from kvstore.connectors.vllm.config import ConnectorSettings, EngineKV
from kvstore.connectors.vllm.events import stored_chunks
from kvstore.connectors.vllm.metadata import SaveSpec
from kvstore.errors import KVStoreError
from kvstore.kvcopy.engine import BlockIndex, ChunkCopier
from kvstore.kvcopy.paged import PagedLayer
from kvstore.kvcopy.streams import StepDone
from kvstore.kvcopy.verified import Hasher

logger = logging.getLogger(__name__)


@dataclass
class _StepSaves:
    """One step's reservations, and the running digest of each reserved chunk."""

    reserved: list[tuple[SaveSpec, SaveReservation]]
    digests: dict[int, list[Hasher]] = field(default_factory=dict)  # per save id
    # per (save id, stored block, KV cache group): its engine blocks, built once per step
    indexes: dict[tuple[int, int, int], BlockIndex] = field(default_factory=dict)
    layers: int = 0  # layers saved so far
    in_order: bool = True  # layers arrived in payload order: the running digests are valid
    done: StepDone | None = None  # CUDA: the step's copies and hashes (None: done)


class SavePipeline:
    def __init__(
        self,
        settings: ConnectorSettings,
        kv: EngineKV,
        agent: AgentConnection,
        stats: dict,
        groups: compat.CacheGroups = compat.ONE_GROUP,
    ) -> None:
        self.settings = settings
        self.kv = kv
        self.agent = agent
        self.stats = stats
        self.copier: ChunkCopier | None = None  # set by the worker once caches are registered
        self.layer_groups: list[int] = []  # per payload layer: its KV cache group (the worker's)
        # vLLM frees a sliding-window block once out of the window, and may reuse it next step:
        # such saves complete within their step (on CUDA, the copy stream is waited for).
        self._sync_each_step = any(window is not None for window in groups.windows)
        self.delayed_frees = compat.saves_outlive_steps()  # as the scheduler half decides
        self._step: _StepSaves | None = None
        self._submitted: list[_StepSaves] = []  # copies may still run; commit in order
        self._uncommitted: dict[str, int] = {}  # req id -> submitted steps not yet committed
        self._requests_with_saves: set[str] = set()
        self._finished: set[str] = set()  # finished by vLLM, waiting for their commits
        self._load_failed: set[str] = set()  # requests whose saves are never committed
        self._failed_finished: set[str] = set()  # of those, finished, saves still submitted
        self.committed: list[bytes] | None = None  # with KV events: chunks stored this step
        # the step's reservations, asked for as it starts: (spec, its answer when read)
        self._asked: list[tuple[SaveSpec, Callable[[], SaveReservation]]] = []

    def expect(self, saves: list[SaveSpec]) -> None:
        """The step's save specs, seen before its forward: their pages are asked for now (read
        at the first save_layer). Each request named is reported by finished_saving once
        finished, even if none of its layers reach save_layer (the scheduler delays its
        blocks' free on that promise)."""
        if self.delayed_frees:
            self._requests_with_saves.update(spec.req_id for spec in saves)
        if self._asked:  # a step that never ended (its forward failed)
            self._abort_unwritten()
        self._ask_all(saves)

    def _ask_all(self, saves: list[SaveSpec]) -> None:
        for spec in saves:
            asked = self._ask(spec)
            if asked is None:
                break
            self._asked.append((spec, asked))

    def _ask(self, spec: SaveSpec) -> Callable[[], SaveReservation] | None:
        """Send the reservation of `spec`'s chunks; None without an agent, or when sending
        fails (the step saves nothing then)."""
        layout = self.kv.block_layout(spec.tail_blocks)
        try:
            if self.agent.client is None:
                return None
            return self.agent.client.save_sent(
                self.settings.tenant,
                self.kv.block_keys(spec.keys),
                layout.payload_bytes,
                first_parent=self.kv.parent_key(spec.first_parent) or None,
                layout_hash=layout.layout_hash,
                codec_id=CODEC_IDS[layout.codec],
            )
        except KVStoreError as exc:
            logger.warning("kvstore save skipped (%s)", exc)
            self.stats["save_failures"] += len(spec.keys)
            return None

    def load_failed(self, req_id: str) -> None:
        """A load of `req_id` failed: the chunks it computes over the missing blocks are
        wrong, so none of its saves is committed any more (their reservations are aborted);
        vLLM recomputes from the failed block."""
        self._load_failed.add(req_id)

    def save_layer(self, saves: list[SaveSpec], layer: int, paged: PagedLayer) -> None:
        """Copy layer `layer` of the step's reserved chunks into their pages (reserved now
        if `expect` did not ask for them)."""
        if self._step is None:
            if not self._asked:
                self._ask_all(saves)
            self._step = self._reserve()
        step = self._step
        step.in_order &= layer == step.layers
        step.layers += 1
        self.copier.after_compute()  # CUDA: the layer's attention wrote it on the compute stream
        cache_group = self.layer_groups[layer]
        for spec, reservation in step.reserved:
            layout = self.kv.block_layout(spec.tail_blocks)
            start, stop = layout.layer_range(layer)
            digests = step.digests[reservation.save_id]
            for index, payload in enumerate(reservation.payloads):  # chunk-major, group-minor
                if payload is not None:
                    chunk, group = divmod(index, self.kv.groups.count)
                    self.copier.save_layer(
                        self.kv.group_view(paged, group),
                        step.indexes[reservation.save_id, chunk, cache_group],
                        payload[start:stop],
                        digests[index] if step.in_order else None,
                        layout,
                    )

    def _blocks(self, spec: SaveSpec, chunk: int, cache_group: int) -> list[int]:
        """The engine blocks of stored block `chunk`: a whole chunk's, or the tail's."""
        per_chunk = spec.tail_blocks or self.kv.blocks_per_chunk
        ids = spec.block_ids[cache_group]
        return ids[chunk * per_chunk : (chunk + 1) * per_chunk]

    def _index(self, step: _StepSaves, spec: SaveSpec, reservation: SaveReservation) -> None:
        """Build the engine blocks' index of each reserved block, once for every layer (and
        before the copy stream is ordered after the compute stream, which builds them)."""
        for index, payload in enumerate(reservation.payloads):
            chunk = index // self.kv.groups.count
            for cache_group in set(self.layer_groups):
                key = (reservation.save_id, chunk, cache_group)
                if payload is not None and key not in step.indexes:
                    blocks = self._blocks(spec, chunk, cache_group)
                    step.indexes[key] = self.copier.block_index(blocks)

    def _reserve(self) -> _StepSaves:
        """The step's reservations, as the agent answered them."""
        step = _StepSaves([])
        asked, self._asked = self._asked, []
        for spec, answer in asked:
            try:
                reservation = answer()
            except KVStoreError as exc:
                logger.warning("kvstore save skipped (%s)", exc)
                self.stats["save_failures"] += len(spec.keys)
                continue
            step.reserved.append((spec, reservation))
            step.digests[reservation.save_id] = [Hasher() for _ in reservation.payloads]
            self._index(step, spec, reservation)
        return step

    # ---- commits ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """The step's copies are all submitted: commit what is done (everything, on the CPU).
        Reservations no layer was saved into are aborted."""
        if self._asked:
            self._abort_unwritten()
        step, self._step = self._step, None
        if step is not None:
            if self.copier is not None:
                step.done = self.copier.streams.step_done()
            for spec, _ in step.reserved:
                self._uncommitted[spec.req_id] = self._uncommitted.get(spec.req_id, 0) + 1
            self._submitted.append(step)
        self.commit_ready(block=self._sync_each_step)

    def commit_ready(self, block: bool) -> None:
        """Commit submitted steps whose copies completed, in order (all of them with
        `block`: before a preempted request's blocks may be overwritten, or at shutdown)."""
        while self._submitted:
            step = self._submitted[0]
            if step.done is not None and not block and not step.done.query():
                return
            if step.done is not None:
                step.done.synchronize()
            self._submitted.pop(0)
            self._commit(step)
        self.agent.drop_if_broken()

    def _commit(self, step: _StepSaves) -> None:
        complete = step.in_order and step.layers == self.kv.layout.num_layers
        for spec, reservation in step.reserved:
            self._uncommitted[spec.req_id] -= 1
            if not self._uncommitted[spec.req_id]:
                del self._uncommitted[spec.req_id]
            if spec.req_id in self._load_failed:
                self._drop(reservation)
                continue
            if not reservation.reserved_keys():  # every chunk was stored already
                self._forget(reservation)
                continue
            try:
                checksums = _checksums(reservation, step.digests[reservation.save_id], complete)
                committed = self.agent.client.commit(reservation, checksums=checksums)
            except (KVStoreError, AttributeError) as exc:  # AttributeError: agent gone
                logger.warning("kvstore commit failed (%s)", exc)
                self.stats["save_failures"] += len(reservation.reserved_keys())
                continue
            self.stats["saved_blocks"] += committed
            whole = not spec.tail_blocks  # a tail is no block of vLLM's: no KV event
            if (
                self.committed is not None
                and whole
                and committed == len(reservation.reserved_keys())
            ):
                groups = self.kv.groups.count
                self.committed += stored_chunks(spec.keys, reservation.payloads, groups)
            self.stats["saved_bytes"] += (
                committed * self.kv.block_layout(spec.tail_blocks).payload_bytes
            )

    def _abort_unwritten(self) -> None:
        """Reservations asked for that no layer was saved into: dropped."""
        asked, self._asked = self._asked, []
        for _, answer in asked:
            try:
                self._forget(answer())
            except KVStoreError as exc:
                logger.info("kvstore save skipped (%s)", exc)

    def _drop(self, reservation: SaveReservation) -> None:
        self.stats["saves_dropped_after_load_errors"] += len(reservation.reserved_keys())
        try:
            self.agent.client.abort(reservation)
        except (KVStoreError, AttributeError) as exc:  # the agent frees a broken connection's
            logger.info("kvstore abort failed (%s)", exc)

    def _forget(self, reservation: SaveReservation) -> None:
        """A reservation of no page: the agent drops it, nobody waits for the answer."""
        try:
            self.agent.client.abort(reservation, wait=False)
        except (KVStoreError, AttributeError) as exc:
            logger.info("kvstore abort failed (%s)", exc)

    def forget(self, req_ids: set[str]) -> None:
        """Requests preempted after every save was committed: vLLM freed their blocks, and
        must not hear of them from finished_saving (an aborted one is gone from vLLM)."""
        self._requests_with_saves -= req_ids
        self._finished -= req_ids

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are all committed: their blocks may be freed."""
        self.commit_ready(block=False)
        self._finished |= finished_req_ids & self._requests_with_saves
        done = {r for r in self._finished if not self._uncommitted.get(r)}
        self._finished -= done
        self._requests_with_saves -= done
        self._forget_load_failures(finished_req_ids)
        return done

    def _forget_load_failures(self, finished_req_ids: set[str]) -> None:
        """A finished request's load failure is kept until its last submitted save is gone."""
        self._failed_finished |= finished_req_ids & self._load_failed
        settled = {r for r in self._failed_finished if not self._uncommitted.get(r)}
        self._failed_finished -= settled
        self._load_failed -= settled


def _checksums(reservation: SaveReservation, digests, complete: bool) -> list[int]:
    """The payloads' xxh3, hashed as they were written (every layer, in order); else []
    and the agent hashes them at commit."""
    if not complete:
        return []
    return [
        d.intdigest()
        for d, view in zip(digests, reservation.payloads, strict=True)
        if view is not None
    ]
