"""The scheduler's lookup queue, narrated with lookup functions that stand in for the agent
(this layer only; the real engines and agents are in test_hit_tiers.py and
test_lookups_never_block.py): a request whose chunks must be staged (a slow disk, another
host) is staged on its own thread, so a request behind it whose chunks are in the arena is
answered at once."""

import threading
import time

import pytest

from kvstore.client import LookupCounts
from kvstore.connectors.vllm.config import ConnectorSettings
from kvstore.connectors.vllm.lookups import LookupQueue
from kvstore.errors import ConfigError

STAGE_S = 0.5


def poll(queue: LookupQueue, req_id: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queue.new_step()
        answer = queue.answer(req_id, [b"k"])
        if answer is not None:
            return answer
        time.sleep(0.005)
    raise AssertionError(f"no answer for {req_id}")


def test_a_slow_staging_does_not_hold_up_the_next_lookup():
    staged = threading.Event()

    def lookup(req_id, keys):
        if req_id == "on-disk":

            def stage():
                time.sleep(STAGE_S)
                staged.set()
                return LookupCounts(4, 0, "dddd")

            return stage
        return LookupCounts(2, 0, "hh")

    queue = LookupQueue(lookup)
    try:
        assert queue.answer("on-disk", [b"k"]) is None  # staging: in flight
        started = time.monotonic()
        fast = poll(queue, "in-arena")
        assert time.monotonic() - started < STAGE_S / 3 and not staged.is_set()
        assert fast.counts == LookupCounts(2, 0, "hh")
        slow = poll(queue, "on-disk")
        assert slow.counts == LookupCounts(4, 0, "dddd") and slow.lookup_s >= STAGE_S
        assert queue.in_flight == 0
    finally:
        queue.close()


def test_a_failed_staging_is_a_miss_with_its_error():
    def lookup(req_id, keys):
        def stage():
            raise RuntimeError("agent gone")

        return stage

    queue = LookupQueue(lookup)
    try:
        answer = poll(queue, "r")
        assert answer.counts is None and "agent gone" in answer.error
    finally:
        queue.close()


def test_a_request_that_left_is_not_staged():
    ran: list[str] = []

    def lookup(req_id, keys):
        def stage():
            ran.append(req_id)
            time.sleep(STAGE_S if req_id == "first" else 0)
            return LookupCounts(1, 0, "d")

        return stage

    queue = LookupQueue(lookup, stage_threads=1)
    try:
        assert queue.answer("first", [b"k"]) is None  # staging for STAGE_S
        assert queue.answer("left", [b"k"]) is None  # its staging queues behind
        time.sleep(0.05)  # its lookup is done: only the staging is pending
        queue.discard("left")
        assert poll(queue, "first").counts == LookupCounts(1, 0, "d")
        time.sleep(0.05)
        assert ran == ["first"], "the request that left was staged"
    finally:
        queue.close()


def test_two_stagings_run_at_once_on_two_staging_threads():
    """Two requests whose chunks must be staged: with one staging thread the second waits for
    the first (2 x STAGE_S); with two, both are answered within about one STAGE_S."""

    def lookup(req_id, keys):
        def stage():
            time.sleep(STAGE_S)
            return LookupCounts(0, 3, "rrr")

        return stage

    for threads, lower_s, upper_s in ((1, 2 * STAGE_S, 5.0), (2, STAGE_S, 1.9 * STAGE_S)):
        queue = LookupQueue(lookup, stage_threads=threads)
        try:
            started = time.monotonic()
            assert queue.answer("a", [b"k"]) is None and queue.answer("b", [b"k"]) is None
            answers = [poll(queue, "a"), poll(queue, "b")]
            took_s = time.monotonic() - started
            assert all(a.counts == LookupCounts(0, 3, "rrr") for a in answers)
            assert lower_s <= took_s < upper_s, f"{threads} thread(s): {took_s:.2f} s"
        finally:
            queue.close()


@pytest.mark.parametrize("threads", [0, 17])
def test_a_number_of_staging_threads_out_of_range_is_refused(threads):
    with pytest.raises(ConfigError, match=r"stage_threads must be in \[1, 16\]"):
        ConnectorSettings.from_extra_config({"stage_threads": threads})
