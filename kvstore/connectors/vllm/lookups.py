"""Prompt lookups off the scheduler's thread. A lookup that must ask the metadata service about
other hosts, or bring chunks into this host's arena (promote them from disk, pull them from
another host), takes time; vLLM's scheduler must not wait for it, so the connector answers
"not yet" (None) and vLLM asks again on a later step. Runs in vLLM's scheduler process: a
lookup thread (the agent's answer, the load-or-compute decision) and staging threads (the
promotions and pulls; `stage_threads` requests at once), each on its own agent connection, so a
request whose chunks are on a slow disk or another host never holds up the lookup of one whose
chunks are in the arena, nor, up to that many, the staging of another.
Also: per-chunk tiers of an answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvstore.client import TIERS, LookupCounts

IN_FLIGHT_MAX = 1024  # lookups queued or running; beyond it a request waits to submit one
ANSWER_TTL_S = 1.0  # an answer this old is asked again (the store may have changed since)
INLINE_WAIT_S = 0.002  # per scheduler step: fast (local) answers are taken at once


@dataclass
class Answer:
    counts: LookupCounts | None  # None: the lookup failed
    error: str
    lookup_s: float  # from the lookup's start to its answer, staging included
    answered_at: float
    counted: bool = False  # in the scheduler's stats (an answer may be read on several polls)


class LookupQueue:
    """Lookups by request id: `submit`, then `poll` until an Answer; `discard` when the request
    leaves. Each scheduler step may spend at most INLINE_WAIT_S waiting, in total."""

    def __init__(self, lookup, stage_threads: int = 1) -> None:
        # (request id, chain keys) -> LookupCounts, or the staging that returns them (run on
        # a staging thread); raises KVStoreError
        self._lookup = lookup
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-lookup")
        self._stager = ThreadPoolExecutor(stage_threads, thread_name_prefix="kvstore-stage")
        self._futures: dict[str, Future] = {}
        self._answers: dict[str, Answer] = {}
        self._wait_left_s = INLINE_WAIT_S

    def answer(self, req_id: str, keys: list[bytes]) -> Answer | None:
        """The fresh answer for this request's keys, or None while its lookup (or staging) is
        in flight (a lookup is submitted if none is, and the queue has room)."""
        answer = self._answers.get(req_id)
        if answer is not None and time.monotonic() - answer.answered_at < ANSWER_TTL_S:
            return answer
        future = self._futures.get(req_id)
        if future is None:
            if len(self._futures) >= IN_FLIGHT_MAX:
                return None
            future = self._futures[req_id] = self._executor.submit(self._timed, req_id, keys)
        result = self._result(future)
        if isinstance(result, Future):  # looked up; its staging is queued
            future = self._futures[req_id] = result
            result = self._result(future)
        if result is None:
            return None
        del self._futures[req_id]
        answer = self._answers[req_id] = result
        return answer

    def _result(self, future: Future):
        """The future's result, waited for within this step's inline budget; None if not done."""
        if not future.done() and self._wait_left_s > 0:
            started = time.monotonic()
            wait([future], timeout=self._wait_left_s)
            self._wait_left_s -= time.monotonic() - started
        return future.result() if future.done() else None

    def _timed(self, req_id: str, keys: list[bytes]) -> Answer | Future:
        started = time.perf_counter()
        try:
            result = self._lookup(req_id, keys)
        except Exception as exc:  # KVStoreError, or a client broken under us: a miss
            return Answer(None, str(exc), time.perf_counter() - started, time.monotonic())
        if not callable(result):
            return Answer(result, "", time.perf_counter() - started, time.monotonic())
        try:
            return self._stager.submit(self._staged, started, result)
        except RuntimeError as exc:  # closed: the connector is shutting down
            return Answer(None, str(exc), time.perf_counter() - started, time.monotonic())

    def _staged(self, started: float, stage: Callable[[], LookupCounts]) -> Answer:
        try:
            counts, error = stage(), ""
        except Exception as exc:  # as in _timed: a miss
            counts, error = None, str(exc)
        return Answer(counts, error, time.perf_counter() - started, time.monotonic())

    def new_step(self) -> None:
        self._wait_left_s = INLINE_WAIT_S

    def discard(self, req_id: str) -> None:
        """The request left: drop its answer; cancel its lookup, or the staging that lookup
        queues (a finished request's chunks are not brought into the arena)."""
        self._answers.pop(req_id, None)
        future = self._futures.pop(req_id, None)
        if future is not None and not future.cancel():
            future.add_done_callback(_cancel_staging)

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._stager.shutdown(wait=False, cancel_futures=True)


def _cancel_staging(lookup: Future) -> None:
    """Done callback of a discarded request's lookup: cancel the staging it queued, if any
    (one already running finishes: it pins and releases, nothing more)."""
    if not lookup.cancelled() and isinstance(staging := lookup.result(), Future):
        staging.cancel()


def chunk_tiers(counts: LookupCounts, groups: int) -> list[str]:
    """The tier of each whole chunk of an agent's answer over chunk-major block keys (`groups`
    blocks a chunk): the farthest of its blocks' tiers (host < disk < remote)."""
    names = counts.tier_names()
    return [
        max(names[start : start + groups], key=TIERS.index)
        for start in range(0, len(names) - groups + 1, groups)
    ]


def tokens_by_tier(tiers: list[str], chunk_tokens: int, first: int, count: int) -> dict[str, int]:
    """How many of the tokens [first, first + count) each tier supplies, chunk i of `tiers`
    covering tokens [i * chunk_tokens, (i + 1) * chunk_tokens); only non-zero shares."""
    shares: dict[str, int] = {}
    for index, tier in enumerate(tiers):
        start = max(first, index * chunk_tokens)
        stop = min(first + count, (index + 1) * chunk_tokens)
        if stop > start:
            shares[tier] = shares.get(tier, 0) + stop - start
    return shares
