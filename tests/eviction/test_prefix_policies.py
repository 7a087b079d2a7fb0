"""The prefix-aware policies, narrated and fuzzed: a chunk is useless without its parent, so a
key with a resident child is never a victim and evicting never leaves an orphan behind."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.eviction import make_policy
from tests.eviction.helpers import everything, evict_one, key

PREFIX_POLICIES = ["prefix-lru", "prefix-reuse", "prefix-arc"]
CHAIN = [key(f"chain-{n}") for n in range(4)]


def insert_chain(policy, keys, parent=None):
    for child in keys:
        policy.insert(child, parent)
        parent = child


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_a_chain_is_evicted_from_its_tail(name):
    policy = make_policy(name)
    insert_chain(policy, CHAIN)
    for chunk in CHAIN:
        policy.touch(chunk)
    assert [evict_one(policy) for _ in CHAIN] == CHAIN[::-1]


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_a_parent_arriving_after_its_children_waits_for_them(name):
    policy = make_policy(name)
    for parent, child in reversed(list(zip([None, *CHAIN], CHAIN, strict=False))):
        policy.insert(child, parent)  # how a demotion fills the tier below: tail first
    assert evict_one(policy) == CHAIN[-1]


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_a_pinned_leaf_shields_its_ancestors(name):
    policy = make_policy(name)
    insert_chain(policy, CHAIN)
    assert policy.victim(lambda candidate: candidate != CHAIN[-1]) is None


def test_prefix_lru_prefers_the_least_recently_used_leaf():
    policy = make_policy("prefix-lru")
    insert_chain(policy, CHAIN[:2])
    other = [key("other-0"), key("other-1")]
    insert_chain(policy, other)
    policy.touch(CHAIN[0])
    policy.touch(CHAIN[1])
    assert policy.victim(everything) == other[1]


def test_prefix_reuse_evicts_a_request_end_before_older_leaves():
    policy = make_policy("prefix-reuse")
    insert_chain(policy, CHAIN[:2])
    policy.touch(CHAIN[0])
    policy.touch(CHAIN[1])  # an older chain that was read: not a request end
    ended = [key("ended-0"), key("ended-1")]
    insert_chain(policy, ended)
    insert_chain(policy, [key("next-request")])  # ended-1 is no longer the latest insert
    assert policy.victim(everything) == ended[1]
    policy.remove(ended[1])
    assert policy.victim(everything) == ended[0]  # now an ordinary leaf: the oldest one unread


def test_prefix_reuse_keeps_a_reused_chain_longer_than_prefix_lru_does():
    victims = {}
    for name in ("prefix-lru", "prefix-reuse"):
        policy = make_policy(name, **({"capacity_blocks": 10} if name == "prefix-reuse" else {}))
        insert_chain(policy, CHAIN[:2])
        policy.touch(CHAIN[0])
        policy.touch(CHAIN[1])
        insert_chain(policy, [key("fresh-0"), key("fresh-1")])  # newer, never read
        victims[name] = policy.victim(everything)
    assert victims == {"prefix-lru": CHAIN[1], "prefix-reuse": key("fresh-1")}


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "touch", "evict"]),
        st.integers(min_value=0, max_value=1_000),
        st.frozensets(st.integers(min_value=0, max_value=40), max_size=6),
    ),
    max_size=120,
)


@pytest.mark.parametrize("name", PREFIX_POLICIES)
@settings(max_examples=60, deadline=None)
@given(operations=OPERATIONS)
def test_no_victim_ever_has_a_resident_child(name, operations):
    policy = make_policy(name)
    parent_of: dict = {}  # the model: resident key -> parent
    for number, (operation, choice, pinned_ids) in enumerate(operations):
        resident = list(parent_of)
        if operation == "insert":
            parent = resident[choice % len(resident)] if resident and choice % 4 else None
            child = key(f"k-{number}")
            policy.insert(child, parent)
            parent_of[child] = parent
        elif operation == "touch" and resident:
            policy.touch(resident[choice % len(resident)])
        elif operation == "evict":
            pinned = {resident[i] for i in pinned_ids if i < len(resident)}
            victim = policy.victim(lambda candidate, pinned=pinned: candidate not in pinned)
            parents = set(parent_of.values())
            evictable_leaves = [k for k in resident if k not in parents and k not in pinned]
            if victim is None:
                assert not evictable_leaves
            else:
                assert victim in evictable_leaves
                policy.remove(victim)
                del parent_of[victim]
        assert len(policy) == len(parent_of)
        assert all(parent is None or parent in parent_of for parent in parent_of.values())


@pytest.mark.parametrize(("ghost_ratio", "expected"), [(2.0, "fresh"), (0.0, "comeback")])
def test_prefix_reuse_protects_a_key_asked_for_again_after_its_eviction(ghost_ratio, expected):
    policy = make_policy(
        "prefix-reuse", capacity_blocks=10, ghost_ratio=ghost_ratio, end_first=False
    )
    comeback = key("comeback")
    policy.insert(comeback, None)
    assert evict_one(policy) == comeback
    policy.insert(comeback, None)  # back again: a miss that should have been a hit
    policy.insert(key("fresh"), None)  # newer, never read
    policy.insert(key("latest"), None)
    assert policy.victim(everything) == key(expected)  # without a ghost list: plain recency


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_parents_claimed_in_a_cycle_cannot_make_keys_unevictable(name):
    """A key its own parent, or two keys each other's: none was ever a leaf, so none was
    ever a victim, and a full tier refused every save. The claim that closes a cycle is
    ignored (that key is a root)."""
    policy = make_policy(name)
    a, b, c = key("a"), key("b"), key("c")
    policy.insert(a, a)
    policy.insert(b, c)
    policy.insert(c, b)  # closes b -> c -> b: c is a root, b its child
    assert [evict_one(policy) for _ in range(3)] == [a, b, c]


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_appending_to_a_chain_walks_no_ancestors(name, monkeypatch):
    """The cycle check walked every ancestor on each insert: a chain of n chunks cost O(n^2)
    under the store lock (16k chunks took 11 s). Only a key some resident key names as its
    parent can close a cycle, so appending walks nothing."""
    policy = make_policy(name)
    walks = []
    real = policy._is_ancestor
    monkeypatch.setattr(policy, "_is_ancestor", lambda *a: walks.append(a) or real(*a))
    chain = [key(f"long-{n}") for n in range(200)]
    insert_chain(policy, chain)
    assert walks == []
    policy.insert(key("root-x"), chain[-1])  # a new key: no resident child, no walk
    assert walks == []
