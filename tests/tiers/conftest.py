"""One factory per tier implementation; the contract suite runs against each."""

import pytest

from kvstore.tiers import DiskTier, HostTier
from kvstore.tiers.throttled import ThrottledDiskTier

PAGE_BYTES = 4096
CAPACITY_PAGES = 4


def _make(kind, tmp_path):
    capacity = CAPACITY_PAGES * PAGE_BYTES
    if kind == "host":
        return HostTier(capacity, PAGE_BYTES)
    if kind == "disk-throttled":
        return ThrottledDiskTier(tmp_path / "disk", capacity, PAGE_BYTES, read_bytes_per_s=1 << 30)
    return DiskTier(tmp_path / "disk", capacity, PAGE_BYTES)


@pytest.fixture(params=["host", "disk", "disk-throttled"])
def tier(request, tmp_path):
    with _make(request.param, tmp_path) as made:
        yield made
