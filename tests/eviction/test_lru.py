"""LRU, narrated: the victim is the key whose last insert or touch is oldest."""

from kvstore.eviction import make_policy
from tests.eviction.helpers import everything, evict_one, key

A, B, C = key("a"), key("b"), key("c")


def test_the_least_recently_used_key_goes_first():
    lru = make_policy("lru")
    for name in (A, B, C):
        lru.insert(name, None)
    lru.touch(A)  # order is now B, C, A
    assert [evict_one(lru) for _ in range(3)] == [B, C, A]


def test_a_pinned_oldest_key_is_passed_over_not_forgotten():
    lru = make_policy("lru")
    for name in (A, B, C):
        lru.insert(name, None)
    assert lru.victim(lambda candidate: candidate != A) == B
    assert lru.victim(everything) == A


def test_lru_ignores_the_prefix_tree():
    lru = make_policy("lru")
    lru.insert(A, None)
    lru.insert(B, A)
    assert lru.victim(everything) == A  # a parent before its child: the prefix policies differ
