"""`kvstore bench eviction` on a slice of the conversation trace: one JSON object on stdout with
every policy at every capacity, none above Belady's offline optimum on the same requests, and
a time per access for each policy. Checks the report, not this machine's speed."""

import json
import subprocess
import sys


def test_the_eviction_bench_reports_each_policy_against_belady():
    command = [
        *(sys.executable, "-m", "kvstore", "bench", "eviction"),
        *("--slice-from", "0.5", "--slice-to", "0.53", "--capacities", "300,600"),
        *("--timing-capacity", "300", "--timing-runs", "1", "--json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout)
    assert report["slice"] == [0.5, 0.53]
    rows = {(row["policy"], row["capacity_blocks"]): row for row in report["hit_ratios"]}
    policies = ("lru", "prefix-reuse", "reuse-interval")
    assert set(rows) == {(policy, size) for policy in policies for size in (300, 600)}
    for row in rows.values():
        assert 0 < row["block_hit_ratio"] <= row["belady_block_hit_ratio"], row
        assert row["x_belady"] == round(row["block_hit_ratio"] / row["belady_block_hit_ratio"], 3)
    assert rows["lru", 300]["block_hit_ratio"] <= rows["lru", 600]["block_hit_ratio"]
    assert set(report["ns_per_access"]) == set(policies)
    assert all(ns > 0 for ns in report["ns_per_access"].values())
