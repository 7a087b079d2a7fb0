"""`kvstore bench gpu --device cpu` runs the GPU check's code in CI, so it cannot rot: one JSON
object on stdout with the figures the issue names, the bytes loaded equal to the bytes saved."""

import json
import os
import subprocess
import sys


def test_the_gpu_check_runs_on_the_cpu_and_its_bytes_are_equal():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--quick",
            "--runs",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)  # exactly one JSON object: json.loads refuses more
    assert result["device"] == "cpu"
    assert result["bytes_equal"] is True and result["checksums_ok"] is True
    for name in ("save_vs_copy", "load_vs_copy", "compute_slowdown"):
        assert isinstance(result[name], float)


def test_the_gpu_check_refuses_cuda_where_there_is_none():
    """A CPU figure must never pass for the GPU's: with no CUDA device visible (CUDA_VISIBLE_DEVICES
    empty), `--device cuda` fails with the reason, and measures nothing."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "gpu", "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode != 0 and out.stdout == ""
    assert "no CUDA device is visible" in out.stderr and "--device cpu" in out.stderr
