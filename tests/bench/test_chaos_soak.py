"""The chaos and soak benchmarks run end to end, briefly, as `kvstore bench ... --json` child
processes: the JSON has every field, no load returns wrong bytes, chaos really kills, nothing
(process or arena file) is left behind, and a worker that corrupts one expected payload is
caught, so the comparison can fail. The soak's metadata slopes are fitted after its event ring
filled, and a real metadata service's heap stops growing once that ring is full."""

import gc
import json
import os
import secrets
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvstore.bench.soak import ring_bytes_per_event, ring_report
from kvstore.metadata.records import BlockEntry, NodeRecord
from tests.metadata.servers import client_for, running_server

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
MINUTES = "0.3"


def run_bench(*args: str) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


def assert_nothing_left_behind(result: dict) -> None:
    for pid in result["child_pids"]:
        assert not Path(f"/proc/{pid}").exists() or _recycled(pid), f"pid {pid} lives"
        assert not list(Path("/dev/shm").glob(f"kvstore-arena-{pid}-*")), f"arena of {pid}"


def _recycled(pid: int) -> bool:
    """A recycled pid is someone else's process: ours all ran `python -m kvstore...`."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    return b"kvstore" not in cmdline


def test_chaos_kills_and_restarts_processes_and_never_serves_wrong_bytes():
    result = run_bench("chaos", "--minutes", MINUTES, "--seed", "1")
    for field in (
        "operations",
        "loads",
        "hits",
        "wrong_results",
        "kills",
        "recovery_s_p50",
        "recovery_s_p99",
        "lost_blocks",
        "minutes",
        "seed",
    ):
        assert field in result, field
    assert result["wrong_results"] == 0, result["wrong_examples"]
    assert sum(result["kills"].values()) > 0 and result["recovery_failures"] == 0
    assert result["operations"] > 0 and result["hits"] > 0
    assert 0 < result["recovery_s_p50"] <= result["recovery_s_p99"]
    assert result["lost_blocks"] == 0, result["lost_examples"]
    assert result["seed"] == 1 and result["minutes"] == float(MINUTES)
    assert_nothing_left_behind(result)


def test_a_worker_that_expects_one_wrong_byte_makes_chaos_report_a_wrong_result():
    result = run_bench("chaos", "--minutes", "0.15", "--corrupt-worker", "worker-2.1")
    assert result["wrong_results"] == 1
    assert result["wrong_examples"][0]["worker"] == "worker-2.1"
    assert_nothing_left_behind(result)


def test_soak_reports_first_last_and_slope_of_every_resource_per_role():
    result = run_bench(
        "soak", "--minutes", MINUTES, "--sample-s", "2", "--metadata-max-events", "200"
    )
    assert result["operations"] > 0 and result["errors"] == 0
    assert result["wrong_results"] == 0 and result["lost_blocks"] == 0
    assert result["samples"] >= 5
    for role in ("metadata", "agent", "worker"):
        summary = result["roles"][role]
        for field in (
            "rss_mib_first",
            "rss_mib_last",
            "rss_slope_mib_per_hour",
            "rss_anon_slope_mib_per_hour",
            "threads_last",
            "threads_slope_per_hour",
            "fds_first",
            "fds_slope_per_hour",
        ):
            assert field in summary, (role, field)
        assert summary["rss_mib_last"] > 0
    assert "arena_slope_mib_per_hour" in result["shm"]
    ring = result["metadata_ring"]  # 200 events fill within the first samples
    assert ring["max_events"] == 200 and ring["events_emitted"] >= 200, ring
    assert 0 <= ring["full_at_s"] < 60 * float(MINUTES) and 0 < ring["bound_mib"] < 1, ring
    for field in ("rss_slope_mib_per_hour_after_fill", "rss_anon_slope_mib_per_hour_after_fill"):
        assert isinstance(result["roles"]["metadata"][field], float), field
        assert isinstance(result["processes"]["metadata"][field], float), field
    assert set(result["processes"]) >= {"metadata", "agent-1", "worker-3.1"}
    assert_nothing_left_behind(result)


def test_the_ring_report_fits_the_metadata_slopes_after_the_fill_only():
    times_s = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    rss = [100.0, 110.0, 120.0, 120.0, 120.0, 120.0]  # grows while the ring fills (by 20 s)
    rows = [
        {"metadata.rss_mib": v, "process:metadata.rss_mib": v, "ring.events_emitted": e}
        for v, e in zip(rss, [0, 500, 1000, 1500, 2000, 2500], strict=True)
    ]
    ring, slopes = ring_report(times_s, rows, max_events=1000, bytes_per_event=300.0)
    assert ring["full_at_s"] == 20.0 and ring["events_emitted"] == 2500
    assert ring["bound_mib"] == round(1000 * 300 / 2**20, 1)
    assert slopes["metadata"]["rss_slope_mib_per_hour_after_fill"] == 0.0
    assert slopes["process:metadata"]["rss_slope_mib_per_hour_after_fill"] == 0.0
    never, unfitted = ring_report(times_s, rows, max_events=10_000, bytes_per_event=300.0)
    assert never["full_at_s"] is None
    assert unfitted["metadata"]["rss_slope_mib_per_hour_after_fill"] is None


def test_ring_bytes_per_event_measures_a_plausible_size():
    assert 150 < ring_bytes_per_event(2000) < 1000  # an IndexEvent, its key and strings


def _heap_growth_bytes(tmp_path: Path, max_events: int, warm_rounds: int, rounds: int) -> int:
    """Python heap growth of a real metadata service (in-process, over gRPC) across `rounds`
    rounds of publish + lookup + unpublish of a fresh key (two events each), after warming up."""
    with running_server(tmp_path, max_events=max_events) as server, client_for(server) as client:
        lease, _ = client.register_node(NodeRecord("agent-1", "127.0.0.1:1"), 600_000)

        def drive(count: int) -> None:
            for _ in range(count):
                entry = BlockEntry(secrets.token_bytes(16), "host", 1 << 20, 7)
                client.publish("agent-1", lease, "chaos", [entry])
                client.lookup("chaos", [entry.key])
                client.unpublish("agent-1", lease, "chaos", [entry])

        tracemalloc.start()
        try:
            drive(warm_rounds)  # fills a ring of max_events <= 2 * warm_rounds
            gc.collect()  # garbage awaiting collection is no growth: read live memory only
            before = tracemalloc.get_traced_memory()[0]
            drive(rounds)
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()


def test_the_metadata_service_heap_stops_growing_once_its_event_ring_is_full(tmp_path):
    """The soak's metadata RSS slope is its event ring filling (~340 B per event), not a
    leak: with the ring full, 1200 more events leave the heap flat; with room, it grows."""
    full = _heap_growth_bytes(tmp_path / "full", max_events=200, warm_rounds=400, rounds=600)
    filling = _heap_growth_bytes(tmp_path / "room", max_events=10_000, warm_rounds=400, rounds=600)
    print(f"heap growth over 1200 events: ring full {full} B, ring filling {filling} B")
    assert full < 64 << 10, full  # a leak of >= ~55 B per event would exceed it
    assert filling > 1200 * 150, filling  # the same measure sees the ring's growth
