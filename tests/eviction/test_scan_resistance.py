"""Scan resistance, narrated: a stream of keys read once must not flush keys read often.
S3-FIFO, ARC and prefix-arc keep the hot set; LRU, the baseline, loses it."""

import pytest

from kvstore.eviction import make_policy
from tests.eviction.helpers import admit, key

CAPACITY = 10
HOT = [key(f"hot-{n}") for n in range(4)]


def survivors_of_a_scan(name: str) -> int:
    policy = make_policy(name)
    for hot in HOT:
        admit(policy, CAPACITY, hot)
    for _ in range(2):
        for hot in HOT:
            policy.touch(hot)
    for n in range(10 * CAPACITY):
        admit(policy, CAPACITY, key(f"scan-{n}"))
        for hot in HOT:  # the hot set keeps being read now and then
            if n % 7 == 0:
                policy.touch(hot)
    return sum(hot in policy for hot in HOT)


@pytest.mark.parametrize("name", ["s3fifo", "arc", "prefix-arc"])
def test_a_one_time_scan_does_not_flush_the_hot_set(name):
    assert survivors_of_a_scan(name) == len(HOT)


def test_lru_is_flushed_by_the_same_scan():
    assert survivors_of_a_scan("lru") < len(HOT)


def test_s3fifo_readmits_a_key_evicted_from_probation_straight_to_main():
    policy = make_policy("s3fifo")
    first = key("first")
    admit(policy, CAPACITY, first)
    n = 0
    while first in policy:
        admit(policy, CAPACITY, key(f"filler-{n}"))
        n += 1
    admit(policy, CAPACITY, first)  # a ghost hit: it goes to the main queue
    for m in range(3 * CAPACITY):
        admit(policy, CAPACITY, key(f"more-{m}"))
    assert first in policy
