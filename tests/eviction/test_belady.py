"""Belady's MIN, narrated: replay announces next uses; the farthest one is evicted."""

import pytest

from kvstore.eviction import make_policy
from kvstore.eviction.belady import NEVER
from tests.eviction.helpers import everything, key

A, B, C = key("a"), key("b"), key("c")


@pytest.fixture
def belady():
    policy = make_policy("belady")
    for name, position in ((A, 10), (B, 30), (C, 20)):
        policy.set_next_use(name, position)
        policy.insert(name, None)
    return policy


def test_the_key_used_farthest_in_the_future_goes_first(belady):
    assert belady.victim(everything) == B


def test_a_key_never_used_again_goes_before_any_other(belady):
    belady.set_next_use(A, NEVER)
    assert belady.victim(everything) == A


def test_a_new_announcement_reorders_a_resident_key(belady):
    belady.set_next_use(B, 5)
    assert belady.victim(everything) == C


def test_pinned_keys_are_skipped(belady):
    assert belady.victim(lambda candidate: candidate != B) == C


def test_touch_does_not_reorder_and_removal_forgets(belady):
    belady.touch(A)
    assert belady.victim(everything) == B
    belady.remove(B)
    assert belady.victim(everything) == C


def test_a_key_inserted_without_an_announcement_counts_as_never_used():
    policy = make_policy("belady")
    policy.set_next_use(A, 1)
    policy.insert(A, None)
    policy.insert(B, None)
    assert policy.victim(everything) == B
