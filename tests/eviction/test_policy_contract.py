"""The eviction-policy contract, checked for every registered policy: residency bookkeeping,
victims that respect pins, and None when nothing may be evicted."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.eviction import make_policy, policy_names
from kvstore.keys import BlockKey
from tests.eviction.helpers import everything, key

A, B, C, D = (key(name) for name in "abcd")
ALL_POLICIES = policy_names()


def nothing(_: BlockKey) -> bool:
    return False


@pytest.fixture(params=ALL_POLICIES)
def policy(request):
    return make_policy(request.param)


def test_every_policy_in_the_design_is_registered():
    assert {"lru", "prefix-lru", "s3fifo", "arc", "belady"} <= set(ALL_POLICIES)


def test_inserted_keys_are_tracked_until_removed(policy):
    policy.insert(A, None)
    policy.insert(B, A)
    assert len(policy) == 2 and A in policy and B in policy
    policy.remove(A)
    assert len(policy) == 1 and A not in policy and B in policy


def test_inserting_a_resident_key_is_an_error(policy):
    policy.insert(A, None)
    with pytest.raises(ConfigError, match="already resident"):
        policy.insert(A, None)
    assert len(policy) == 1


def test_unknown_keys_are_ignored_by_touch_and_remove(policy):
    policy.insert(A, None)
    policy.touch(B)
    policy.remove(B)
    assert len(policy) == 1 and B not in policy


def test_an_empty_policy_names_no_victim(policy):
    assert policy.victim(everything) is None


def test_no_victim_when_every_key_is_pinned(policy):
    for name in (A, B, C):
        policy.insert(name, None)
    assert policy.victim(nothing) is None
    assert len(policy) == 3


def test_victim_does_not_change_residency(policy):
    policy.insert(A, None)
    policy.insert(B, None)
    chosen = policy.victim(everything)
    assert chosen in (A, B)
    assert len(policy) == 2 and chosen in policy
    assert policy.victim(everything) == chosen  # asking twice names the same key


def test_victim_skips_keys_that_may_not_be_evicted(policy):
    for name in (A, B, C):
        policy.insert(name, None)
    first = policy.victim(everything)
    pinned = {first}
    second = policy.victim(lambda candidate: candidate not in pinned)
    assert second is not None and second != first and second in policy
    pinned.add(second)
    third = policy.victim(lambda candidate: candidate not in pinned)
    assert third is not None and third not in pinned
    pinned.add(third)
    assert policy.victim(lambda candidate: candidate not in pinned) is None


def test_evicting_one_victim_at_a_time_drains_every_key(policy):
    chain = [key(f"chain-{n}") for n in range(6)]
    for parent, child in zip([None, *chain], chain, strict=False):
        policy.insert(child, parent)
    policy.insert(D, None)
    policy.touch(chain[2])
    evicted = []
    while (victim := policy.victim(everything)) is not None:
        assert victim in policy and victim not in evicted
        evicted.append(victim)
        policy.remove(victim)
    assert set(evicted) == {*chain, D} and len(policy) == 0


def test_a_removed_key_can_be_inserted_again(policy):
    policy.insert(A, None)
    policy.remove(A)
    policy.insert(A, None)
    assert A in policy and policy.victim(everything) == A


def test_unknown_policy_names_raise_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as raised:
        make_policy("clairvoyant")
    message = str(raised.value)
    assert "clairvoyant" in message
    assert all(name in message for name in ALL_POLICIES)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("s3fifo", {"small_ratio": 0.0}),
        ("s3fifo", {"promote_hits": 0}),
        ("arc", {"capacity_blocks": 0}),
        ("prefix-reuse", {"reuse_bonus": -1.0}),
        ("prefix-reuse", {"ghost_ratio": -1.0}),
        ("prefix-reuse", {"capacity_blocks": 0}),
    ],
)
def test_invalid_options_raise_config_error(name, options):
    with pytest.raises(ConfigError):
        make_policy(name, **options)


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "touch", "remove", "evict", "evict"]),
        st.integers(min_value=0, max_value=1_000),
        st.frozensets(st.integers(min_value=0, max_value=30), max_size=5),
    ),
    max_size=100,
)


@pytest.mark.parametrize("name", ALL_POLICIES)
@settings(max_examples=40, deadline=None)
@given(operations=OPERATIONS)
def test_random_operations_keep_the_contract(name, operations):
    policy = make_policy(name)
    parent_of: dict = {}  # the model: resident key -> parent
    for number, (operation, choice, pinned_ids) in enumerate(operations):
        resident = list(parent_of)
        chosen = resident[choice % len(resident)] if resident else key(f"absent-{number}")
        if operation == "insert":
            child = key(f"k-{number}")
            parent = chosen if resident and choice % 3 else None
            policy.insert(child, parent)
            parent_of[child] = parent
        elif operation == "touch":
            policy.touch(chosen)
        elif operation == "remove":
            policy.remove(chosen)
            parent_of.pop(chosen, None)
        else:
            pinned = {resident[i] for i in pinned_ids if i < len(resident)}
            victim = policy.victim(lambda candidate, pinned=pinned: candidate not in pinned)
            parents = set(parent_of.values())
            if victim is None:
                assert all(k in pinned or k in parents for k in resident)
            else:
                assert victim in parent_of and victim not in pinned
                policy.remove(victim)
                del parent_of[victim]
        assert len(policy) == len(parent_of)
        assert all(k in policy for k in parent_of)
