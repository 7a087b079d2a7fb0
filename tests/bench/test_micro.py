"""The micro-benchmark's report: every documented field is there and is a positive number.

Checks the shape of the report in quick mode, not the performance of this machine.
"""

import json
import math

import pytest

from kvstore.bench.micro import run_micro
from kvstore.bench.timing import MemcpyBaseline, gbps, median_time_s
from kvstore.errors import ConfigError

TIERS = ("host", "disk")
TIER_FIELDS = [
    f"{tier}_{name}_{size}"
    for tier in TIERS
    for size in ("4MiB", "16MiB")
    for name in (
        "write_GBps",
        "read_GBps",
        "tier_write_GBps",
        "tier_read_GBps",
        "write_vs_memcpy",
        "read_vs_memcpy",
    )
]
FIELDS = [
    "runs",
    "hash_tokens_per_s",
    "hash_GBps",
    "hash_128k_tokens_ms",
    "memcpy_GBps",
    "memcpy_GBps_4MiB",
    "memcpy_GBps_16MiB",
    "fp8_encode_GBps",
    "fp8_decode_GBps",
    "checksum_GBps",
    "full_arena_save_ms_sync",
    "full_arena_save_ms_ahead",
    "full_arena_copy_ms",
    "full_arena_save_ahead_vs_sync",
    "disk_write_ms_per_block_sync_run",
    "arena_utilisation_shared",
    "arena_utilisation_min_shared",
    "arena_mix_save_GBps_shared",
    "arena_utilisation_one_page_per_block",
    "arena_utilisation_min_one_page_per_block",
    "arena_mix_save_GBps_one_page_per_block",
    "arena_utilisation_shared_vs_one_page",
    *TIER_FIELDS,
]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def report(disk_dir):
    return run_micro(runs=1, quick=True, disk_dir=disk_dir)


@pytest.mark.parametrize("field", FIELDS)
def test_every_documented_field_is_a_positive_finite_number(report, field):
    value = report[field]
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert math.isfinite(value) and value > 0


def test_the_report_names_the_machine_and_is_json(report):
    assert report["machine"]["cpu_count"] >= 1
    assert report["machine"]["torch_version"]
    assert json.loads(json.dumps(report)) == report


def test_the_disk_tier_leaves_nothing_behind(report, disk_dir):
    assert list(disk_dir.iterdir()) == []


def test_blocks_of_five_sizes_fill_at_least_nine_tenths_of_a_shared_arena(report):
    assert report["arena_mix_block_sizes"] == 5
    assert report["arena_utilisation_shared"] >= 0.9
    assert report["arena_utilisation_shared_vs_one_page"] > 1


def test_zero_runs_is_a_config_error():
    with pytest.raises(ConfigError, match="runs"):
        run_micro(runs=0, quick=True)


def test_memcpy_baseline_copies_into_every_row():
    baseline = MemcpyBaseline(block_bytes=1024, blocks=3)
    assert gbps(baseline.total_bytes, median_time_s(baseline.copy_all, runs=3)) > 0
    assert (baseline.rows == 1).all()
