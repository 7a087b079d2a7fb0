"""`kvstore bench eviction` on the second half of a Mooncake-format trace (generated: a clean
checkout has no ../shared): one JSON object on stdout with every policy at every capacity,
none above Belady's offline optimum on the same requests, and a time per access for each
policy. Checks the report, not this machine's speed."""

import json
import subprocess
import sys

import pytest

from tests.plan.traces import write_mooncake


def test_the_eviction_bench_reports_each_policy_against_belady(tmp_path):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=600, seed=3)
    command = [
        *(sys.executable, "-m", "kvstore", "bench", "eviction", "--trace", trace),
        *("--slice-from", "0.5", "--capacities", "30,60"),
        *("--timing-capacity", "30", "--timing-runs", "1", "--json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout)
    assert report["slice"] == [0.5, 1.0]
    rows = {(row["policy"], row["capacity_blocks"]): row for row in report["hit_ratios"]}
    policies = ("lru", "prefix-reuse", "reuse-interval")
    assert set(rows) == {(policy, size) for policy in policies for size in (30, 60)}
    for row in rows.values():
        assert 0 < row["block_hit_ratio"] <= row["belady_block_hit_ratio"], row
        ratio = row["block_hit_ratio"] / row["belady_block_hit_ratio"]
        assert row["x_belady"] == pytest.approx(ratio, abs=2e-3)  # both rounded in the report
    assert rows["lru", 30]["block_hit_ratio"] <= rows["lru", 60]["block_hit_ratio"]
    assert set(report["ns_per_access"]) == set(policies)
    assert all(ns > 0 for ns in report["ns_per_access"].values())
