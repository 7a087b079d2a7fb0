"""The transfer and lookup benchmarks run end to end on tiny sizes and report every field
(shape, not performance: figures come from full runs on a quiet machine)."""

import math

from kvstore.bench.lookup import run_lookup
from kvstore.bench.transfer import run_transfer


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_transfer_benchmark_reports_every_path():
    result = run_transfer(runs=1, sizes_mib=(1,), batch=2)
    for field in (
        "shm_get_GBps",
        "shm_put_GBps",
        "memcpy_GBps",
        "tcp_get_GBps",
        "socket_GBps",
        "ucx_get_GBps",
        "redis_get_GBps",
        "redis_put_GBps",
        "shm_get_vs_memcpy",
        "copy_kernel_GBps",
        "shm_get_vs_copy_kernel",
        "tcp_get_vs_socket",
        "tcp_get_vs_redis",
        "tcp_get_GBps_1MiB",
    ):
        assert positive(result[field]), field
    for end in ("tcp_reader", "tcp_holder", "socket_receiver", "socket_sender"):
        cpu = result[f"{end}_cpu_s_per_GiB"]  # may round to 0 clock ticks on tiny sizes
        assert math.isfinite(cpu) and cpu >= 0, end
    assert result["machine"]["copy_hash_isa"] in ("avx2", "portable")


def test_lookup_benchmark_reports_latency_qps_and_the_redis_baseline():
    result = run_lookup(runs=1, duration_s=0.2, concurrency=(1, 2))
    fields = (
        "lookup_64_p50_us",
        "lookup_512_p50_us",
        "lookup_qps_1_clients",
        "lookup_qps_2_clients",
        "redis_exists_64_p50_us",
        "lookup_64_vs_redis",
        "grpc_echo_64_p50_us",
        "lookup_64_vs_grpc_echo",
        "view_bytes_per_key",
        "publish_keys_per_s_batch_1",
        "publish_keys_per_s_batch_1024",
        "view_lag_p50_ms",
        "view_lag_max_ms",
        "agent_lookup_floor_p50_us",
        "agent_lookup_floor_blocking_p50_us",
        "lookup_unary_64_p50_us",
        "lookup_stream_64_p50_us",
        "grpc_stream_echo_64_p50_us",
        "lookup_64_vs_grpc_stream_echo",
        "tcp_echo_64_p50_us",
        "lookup_64_vs_tcp_echo",
    )
    for field in fields:
        assert positive(result[field]), field
    floors = (
        "grpc_echo_sync_server_64_p50_us",
        "grpc_echo_qps_2_clients",
        "grpc_echo_sync_server_qps_2_clients",
        "lookup_qps_vs_grpc_echo_2_clients",
        "grpc_stream_echo_qps_2_clients",
        "lookup_unary_qps_2_clients",
        "lookup_stream_qps_2_clients",
        "lookup_qps_vs_grpc_stream_echo_2_clients",
        "tcp_echo_qps_2_clients",
        "lookup_qps_vs_tcp_echo_2_clients",
    )
    for field in floors:
        assert positive(result[field]), field
    for field in (
        "lookup_server_cpu_us_1_clients",
        "lookup_server_cpu_us_2_clients",
        "lookup_unary_server_cpu_us_2_clients",
        "lookup_stream_server_cpu_us_2_clients",
        "tcp_echo_server_cpu_us_per_call",
        "grpc_echo_server_cpu_us_per_call",
        "grpc_echo_sync_server_cpu_us_per_call",
        "grpc_stream_echo_server_cpu_us_per_call",
    ):
        cpu = result[field]  # may round to 0 clock ticks on tiny durations
        assert math.isfinite(cpu) and cpu >= 0, field
    assert "share this machine" in result["qps_note"]
    for wait in ("agent_lookup_64_p50_us", "agent_lookup_64_blocking_p50_us"):
        for prompt in ("all_local", "all_remote", "all_absent"):
            assert positive(result[wait][prompt]), (wait, prompt)
    assert result["agent_view"]["ready"] and result["agent_view"]["answered"] > 0
