"""`kvstore bench shards` on a real 3-master Redis Cluster it starts: one JSON object with the
one-slot and the sharded index's publish rates and lookup latencies. Checks the report, not
this machine's speed."""

import json
import subprocess
import sys


def test_the_shards_bench_compares_one_slot_with_the_sharded_index():
    command = [
        *(sys.executable, "-m", "kvstore", "bench", "shards"),
        *("--seconds", "1", "--writers", "1", "--runs", "1", "--json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout)
    assert [row["shards"] for row in report["publish"]] == [1, 12]
    assert all(row["keys"] > 0 and row["keys_per_s"] > 0 for row in report["publish"])
    assert [row["shards"] for row in report["lookup"]] == [1, 12]
    assert all(0 < row["p50_us"] <= row["p99_us"] for row in report["lookup"])
    assert report["sharded_vs_one_slot_keys_per_s"] > 0
