"""The online load-or-recompute planner with the vLLM connector's tiers, narrated: the compute
rate and the host tier come from the engine's steps, the disk tier from the reads timed off the
forward (promotions the staging threads made, background probes); a chunk brought from disk
pays the disk and then the host load, and is loaded only when that beats computing it."""

from kvstore.costmodel import OnlineLoadPlanner

MS = 1e-3


def measured_planner(
    disk_chunk_s: float | None,
    host_chunk_s: float = 1 * MS,
    free_tiers: frozenset[str] = frozenset(),
) -> OnlineLoadPlanner:
    """Three plain steps at 1 ms a token (a 128-token chunk: 128 ms to compute), one step that
    loaded 4 host chunks (decided before the compute rate was known: loaded, as every chunk
    is then), and one timed promotion of 4 disk chunks (None: none yet)."""
    planner = OnlineLoadPlanner(chunk_tokens=128, free_tiers=free_tiers)
    assert planner.chunks_to_load("warm", ["host"] * 4, 600, loaded_from="host") == 4
    now = 0.0
    for number, tokens in enumerate((200, 400, 800)):
        planner.step_started([(f"cold-{number}", tokens, 0)], now)
        now += 10 * MS + tokens * MS
        planner.step_ended(now)
    planner.step_started([("warm", 88, 512)], now)
    planner.step_ended(now + 10 * MS + 88 * MS + 4 * host_chunk_s)
    if disk_chunk_s is not None:
        planner.observe_fetch("disk", 4, 4 * disk_chunk_s)
    return planner


def test_a_slow_disk_is_computed_while_the_host_prefix_before_it_is_loaded():
    planner = measured_planner(disk_chunk_s=1.0)  # 1 s a chunk vs 128 ms to compute it
    per_chunk_s = planner.estimates()[1]
    assert per_chunk_s["disk"] == 1.0 and per_chunk_s["host"] < 5 * MS
    tiers = ["host", "host", "disk", "disk"]
    assert planner.chunks_to_load("next", tiers, 600, loaded_from="host") == 2
    assert planner.recomputed_chunks == 2


def test_a_fast_disk_is_loaded():
    planner = measured_planner(disk_chunk_s=10 * MS)
    tiers = ["host", "disk", "disk", "disk"]
    assert planner.chunks_to_load("next", tiers, 600, loaded_from="host") == 4
    assert planner.recomputed_chunks == 0


def test_a_chunk_brought_from_disk_also_pays_its_host_load():
    """Disk alone (100 ms a chunk) beats computing (128 ms); with the host load after it
    (50 ms) it does not."""
    planner = measured_planner(disk_chunk_s=100 * MS, host_chunk_s=50 * MS)
    assert planner.chunks_to_load("alone", ["disk"] * 4, 600) == 4
    assert planner.chunks_to_load("staged", ["disk"] * 4, 600, loaded_from="host") == 0


def test_an_unmeasured_disk_is_computed_until_a_probe_prices_it():
    """The host prefix before it is loaded; the disk chunks are computed, not loaded to be
    measured (the connector probes the disk in the background)."""
    planner = measured_planner(disk_chunk_s=None, free_tiers=frozenset({"host"}))
    tiers = ["host", "disk", "disk"]
    assert planner.chunks_to_load("found", tiers, 600, loaded_from="host") == 1
    planner.observe_fetch("disk", 1, 2 * MS)  # the probe read one chunk in 2 ms
    assert planner.chunks_to_load("next", tiers, 600, loaded_from="host") == 3


def test_a_free_host_tier_is_loaded_whatever_its_step_residual():
    """A step that loaded host chunks ran 300 ms a chunk over its predicted compute (noise on
    a busy machine: the arena copies a chunk in well under a millisecond). Priced, host
    chunks are recomputed; as the connector's free tier they are loaded, and a disk chunk
    brought into the host pays the disk alone."""
    priced = measured_planner(disk_chunk_s=100 * MS, host_chunk_s=300 * MS)
    assert priced.chunks_to_load("priced", ["host"] * 4, 600, loaded_from="host") == 0
    assert priced.chunks_to_load("staged", ["disk"] * 4, 600, loaded_from="host") == 0
    free = measured_planner(
        disk_chunk_s=100 * MS, host_chunk_s=300 * MS, free_tiers=frozenset({"host"})
    )
    assert free.estimates()[1]["host"] > 200 * MS  # measured, and ignored
    assert free.chunks_to_load("free", ["host"] * 4, 600, loaded_from="host") == 4
    assert free.chunks_to_load("staged", ["disk"] * 4, 600, loaded_from="host") == 4
    assert free.recomputed_chunks == 0
