"""The Tier contract, run against every implementation (device, host, disk)."""

import pytest
import torch

from kvstore.errors import CapacityError, ConfigError, NotFoundError
from kvstore.keys import BlockKey
from tests.tiers.conftest import CAPACITY_PAGES, PAGE_BYTES


def key(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(16, "little"))


def pattern(n: int, size: int = PAGE_BYTES) -> torch.Tensor:
    return (torch.arange(size, dtype=torch.int64) * 31 + n).remainder(251).to(torch.uint8)


def read_back(tier, k):
    with tier.open(k) as view:
        return None if view is None else view.cpu().clone()


def test_a_reserved_page_is_never_readable_until_commit(tier):
    page = tier.reserve(key(1))
    page[:100].copy_(pattern(1, 100).to(page.device))
    assert key(1) not in tier
    assert read_back(tier, key(1)) is None
    assert list(tier.keys()) == []
    tier.commit(key(1), 100)
    assert key(1) in tier
    assert torch.equal(read_back(tier, key(1)), pattern(1, 100))
    assert list(tier.keys()) == [key(1)]


def test_release_frees_reserved_and_committed_pages(tier):
    tier.reserve(key(1))
    tier.write(key(2), pattern(2).to(tier_device(tier)))
    assert tier.used_pages == 2
    tier.release(key(1))
    tier.release(key(2))
    tier.release(key(3))  # unknown: ignored
    assert tier.used_pages == 0 and tier.free_pages == CAPACITY_PAGES
    assert read_back(tier, key(2)) is None


def test_full_tier_raises_capacity_error_and_recovers_after_release(tier):
    for n in range(CAPACITY_PAGES):
        tier.write(key(n), pattern(n).to(tier_device(tier)))
    with pytest.raises(CapacityError, match="full"):
        tier.reserve(key(99))
    tier.release(key(0))
    tier.write(key(99), pattern(99).to(tier_device(tier)))
    assert all(torch.equal(read_back(tier, key(n)), pattern(n)) for n in (1, 2, 3, 99))


def test_double_reserve_and_commit_of_unknown_key_are_errors(tier):
    tier.reserve(key(1))
    with pytest.raises(ConfigError, match="already holds"):
        tier.reserve(key(1))
    with pytest.raises(NotFoundError, match="not reserved"):
        tier.commit(key(2), 10)
    with pytest.raises(ConfigError, match="used_bytes"):
        tier.commit(key(1), PAGE_BYTES + 1)


def test_pages_do_not_overlap(tier):
    for n in range(CAPACITY_PAGES):
        page = tier.reserve(key(n))
        page.copy_(pattern(n).to(page.device))
    for n in range(CAPACITY_PAGES):
        tier.commit(key(n), PAGE_BYTES)
    assert all(torch.equal(read_back(tier, key(n)), pattern(n)) for n in range(CAPACITY_PAGES))


def test_capacity_smaller_than_a_page_names_the_setting(tier, tmp_path):
    kind = type(tier)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        if tier.kind == "disk":
            kind(tmp_path / "other", PAGE_BYTES - 1, PAGE_BYTES)
        else:
            kind(PAGE_BYTES - 1, PAGE_BYTES)


def tier_device(tier) -> torch.device:
    return tier.pages.device if hasattr(tier, "pages") else torch.device("cpu")
