"""`kvstore bench scale` runs end to end on a tiny cluster (4 nodes, 2,000 keys, a few seconds)
and prints one JSON object with every field (shape, not performance)."""

import json
import subprocess
import sys

from tests.plan.traces import write_mooncake

FIELDS = (
    "service_rss_loaded_mib",
    "bytes_per_key",
    "lookups_per_s",
    "lookup_64_p50_us",
    "lookup_64_p99_us",
    "preload_keys_per_s",
    "publish_keys_per_s",
    "evict_keys_per_s",
    "request_lookups_per_s",
    "event_lag_p99_ms",
    "events_received",
)


def test_the_scale_bench_reports_memory_lookups_publishes_events_and_heartbeats(tmp_path):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=200, seed=1)  # not ../shared: CI
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "bench",
        "scale",
        "--nodes",
        "4",
        "--keys",
        "2000",
        "--seconds",
        "4",
        "--agent-processes",
        "2",
        "--trace",
        trace,
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["nodes"] == 4 and result["keys_loaded"] == 2000
    for field in FIELDS:
        assert result[field] > 0, field
    assert result["heartbeats"] > 0 and result["heartbeat_misses"] >= 0
    assert result["errors"] == 0 and result["event_gaps"] == 0
    assert isinstance(result["broke_first"], str) and result["broke_first"]
