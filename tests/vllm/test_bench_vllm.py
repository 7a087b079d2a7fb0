"""`kvstore bench vllm` runs end to end on a short prompt and reports every field (shape, not
performance: figures come from full runs)."""

import math

from kvstore.bench.vllm import run_vllm


def test_vllm_benchmark_reports_ttft_and_speedups():
    result = run_vllm(runs=1, prompt_tokens=1024)
    for field in ("ttft_cold_s", "ttft_cached50_s", "ttft_cached90_s", "speedup50", "speedup90"):
        assert math.isfinite(result[field]) and result[field] > 0, field
    assert result["cached_tokens_cold"] == 0
    assert result["cached_tokens_cached50"] == 512
    assert result["cached_tokens_cached90"] == 768  # 921 shared tokens: 3 whole 256-token chunks
