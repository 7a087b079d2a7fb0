"""prefix-arc, narrated: keys never read wait on probation, reused keys are protected up to a
share of the tier, and the victims that come back move that share, as ARC's ghost lists do."""

import pytest

from kvstore.errors import ConfigError
from kvstore.eviction import make_policy
from tests.eviction.helpers import everything, evict_one, key


def insert_roots(policy, names):
    for name in names:
        policy.insert(key(name), None)


def test_a_key_never_read_goes_before_an_older_key_that_was_read():
    policy = make_policy("prefix-arc", capacity_blocks=10, end_first=False)
    insert_roots(policy, ["read", "unread", "latest"])
    policy.touch(key("read"))
    assert policy.victim(everything) == key("unread")


def test_a_request_end_goes_before_an_older_key_on_probation():
    policy = make_policy("prefix-arc", capacity_blocks=10)
    policy.insert(key("chain-0"), None)
    policy.insert(key("chain-1"), key("chain-0"))
    policy.insert(key("next-request"), None)  # chain-1 ended its request
    policy.remove(key("next-request"))
    assert evict_one(policy) == key("chain-1")


def test_a_key_asked_for_again_after_its_eviction_is_protected():
    policy = make_policy("prefix-arc", capacity_blocks=10, end_first=False)
    insert_roots(policy, ["comeback"])
    assert evict_one(policy) == key("comeback")
    insert_roots(policy, ["comeback", "fresh", "latest"])
    assert policy.victim(everything) == key("fresh")


def test_past_its_share_the_protected_part_gives_up_leaves_first():
    policy = make_policy("prefix-arc", capacity_blocks=4, protected_share=0.25, end_first=False)
    insert_roots(policy, ["read-0", "read-1", "unread"])
    policy.touch(key("read-0"))
    policy.touch(key("read-1"))  # two protected keys, the share allows one
    assert evict_one(policy) == key("read-0")
    assert policy.victim(everything) == key("unread")


@pytest.mark.parametrize(("read_first", "moves"), [(False, -1), (True, +1)])
def test_a_victim_that_comes_back_grows_the_part_it_was_evicted_from(read_first, moves):
    policy = make_policy("prefix-arc", capacity_blocks=10, protected_share=0.5)
    insert_roots(policy, ["comeback"])
    if read_first:
        policy.touch(key("comeback"))
    assert evict_one(policy) == key("comeback")
    insert_roots(policy, ["comeback"])
    assert policy.protected_share == pytest.approx(0.5 + moves * 0.1)


def test_ghost_lists_are_bounded_by_the_capacity():
    policy = make_policy("prefix-arc", capacity_blocks=2, ghost_ratio=1.0, end_first=False)
    insert_roots(policy, [f"gone-{n}" for n in range(5)])
    for _ in range(5):
        evict_one(policy)
    insert_roots(policy, ["gone-0"])  # forgotten: three later victims pushed it out
    assert policy.protected_share == 0.5


@pytest.mark.parametrize(
    "options", [{"ghost_ratio": -1}, {"protected_share": 1.5}, {"capacity_blocks": 0}]
)
def test_settings_out_of_range_are_refused(options):
    with pytest.raises(ConfigError, match="prefix-arc"):
        make_policy("prefix-arc", **options)
