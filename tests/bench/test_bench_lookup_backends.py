"""`kvstore bench lookup`'s backend rows: a service on each backend, its Redis (a redis-server,
a 3-master Redis Cluster, one slot and sharded) started by the bench, answers 64-key lookups on
its lookup port; each latency is reported, and over the memory backend's."""

from kvstore.bench.lookup import BACKENDS, run_backend_lookups


def test_every_backend_answers_on_its_lookup_port_and_is_compared_with_memory():
    result = run_backend_lookups(runs=1, duration_s=0.2)
    for name in ("p50", "p99", "unary_p50"):
        by_backend = result[f"backend_lookup_64_{name}_us"]
        assert set(by_backend) == set(BACKENDS)
        assert all(latency > 0 for latency in by_backend.values()), by_backend
    assert result["backend_lookup_64_p50_vs_memory"]["memory"] == 1.0
    assert result["backend_lookup_64_p99_vs_memory"]["redis"] > 0
    assert result["load_avg_1m"] >= 0
