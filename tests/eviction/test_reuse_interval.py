"""reuse-interval, narrated: a reused key outlives an unused one by the reuse interval the policy
observed (inserts between an access of a key and its next access), not by one capacity."""

import pytest

from kvstore.errors import ConfigError
from kvstore.eviction import make_policy
from tests.eviction.helpers import everything, evict_one, key


def insert_roots(policy, names):
    for name in names:
        policy.insert(key(name), None)


def test_before_any_reuse_the_interval_is_the_capacity_as_in_prefix_reuse():
    assert make_policy("reuse-interval", capacity_blocks=100).reuse_interval == 100


def test_a_hit_teaches_the_inserts_since_the_keys_last_access():
    policy = make_policy("reuse-interval", capacity_blocks=100)
    insert_roots(policy, ["read-later", *[f"filler-{n}" for n in range(9)]])
    policy.touch(key("read-later"))
    assert policy.reuse_interval == 9


def test_a_key_asked_for_again_after_its_eviction_teaches_it_too():
    policy = make_policy("reuse-interval", capacity_blocks=10, end_first=False)
    insert_roots(policy, ["comeback"])
    assert evict_one(policy) == key("comeback")
    insert_roots(policy, [f"filler-{n}" for n in range(4)])
    insert_roots(policy, ["comeback"])  # a miss that a longer stay would have made a hit
    assert policy.reuse_interval == 4


def test_a_reused_key_is_kept_the_learned_interval_longer_not_a_capacity():
    order = {}
    for name in ("prefix-reuse", "reuse-interval"):
        options = {"smoothing": 1.0} if name == "reuse-interval" else {}
        policy = make_policy(name, capacity_blocks=100, end_first=False, **options)
        insert_roots(policy, ["reused", "old-0", "old-1"])
        policy.touch(key("reused"))  # read 2 inserts after its insert
        insert_roots(policy, ["fresh-0", "fresh-1", "fresh-2"])
        order[name] = [evict_one(policy) for _ in range(6)]
    old, fresh = [key("old-0"), key("old-1")], [key(f"fresh-{n}") for n in range(3)]
    assert order["prefix-reuse"] == [*old, *fresh, key("reused")]  # 100 inserts of protection
    assert order["reuse-interval"] == [*old, fresh[0], key("reused"), *fresh[1:]]  # 2 inserts


def test_a_request_end_goes_first_and_a_chain_shrinks_from_its_tail():
    policy = make_policy("reuse-interval")
    chain = [key(f"chain-{n}") for n in range(3)]
    for parent, child in zip([None, *chain], chain, strict=False):
        policy.insert(child, parent)
    policy.touch(chain[0])  # the chain's head was read: the chain is not one request's end
    insert_roots(policy, ["next-request"])  # chain-2 ended its request, unread
    assert policy.victim(everything) == chain[2]
    assert policy.victim(lambda candidate: candidate != chain[2]) != chain[1]  # shielded


def test_the_ghost_list_stays_bounded():
    policy = make_policy("reuse-interval", capacity_blocks=5, ghost_ratio=2.0)
    for n in range(50):
        if len(policy) == 5:
            evict_one(policy)
        insert_roots(policy, [f"once-{n}"])
    assert len(policy._ghosts) == 10


@pytest.mark.parametrize("smoothing", [0.0, -0.1, 1.5])
def test_smoothing_outside_zero_to_one_is_refused(smoothing):
    with pytest.raises(ConfigError, match="smoothing"):
        make_policy("reuse-interval", smoothing=smoothing)
