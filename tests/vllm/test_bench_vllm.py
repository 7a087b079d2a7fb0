"""`kvstore bench vllm` runs end to end on a short prompt and reports every field (shape, not
performance: figures come from full runs). It runs as its own process: an in-process vLLM
engine leaves process-wide state (the KV-transfer group) behind."""

import json
import math
import subprocess
import sys


def test_vllm_benchmark_reports_ttft_and_speedups():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "vllm",
            "--runs",
            "1",
            "--prompt-tokens",
            "1024",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout)  # exactly one JSON object: vLLM's logs go to stderr
    for field in (
        "ttft_cold_s",
        "ttft_cached50_s",
        "ttft_cached90_s",
        "speedup50",
        "speedup90",
        "ttft_cold_no_connector_s",
        "ttft_cached90_engine_s",
        "speedup90_limit",
        "ttft_cold_paired_s",
    ):
        assert math.isfinite(result[field]) and result[field] > 0, field
    assert math.isfinite(result["save_overhead"])
    assert result["cached_tokens_cold"] == 0
    assert result["cached_tokens_cached50"] == 512
    # 921 shared tokens: 3 whole 256-token chunks and a tail of one 128-token block
    assert result["cached_tokens_cached90"] == 896
    assert result["cached_tokens_cached90_engine"] == 896  # the same tokens, from vLLM's own cache
    # a full hit computes one token: the prompt fills its last block, which is loaded too
    assert result["cached_tokens_repeat"] == 1023 and result["computed_tokens_repeat"] == 1
    assert result["loaded_fraction_repeat"] == 1023 / 1024
