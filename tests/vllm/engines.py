"""Run real vLLM engines in their own processes (tests/vllm/engine_runner.py) and read their
results; build the prompts the scenarios share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.vllm.engine_runner import MARK

CHUNK_TOKENS = 128
PROMPT_A = [(i * 7) % 500 + 5 for i in range(600)]
PROMPT_B = PROMPT_A[:520] + [(i * 13) % 500 + 5 for i in range(80)]  # shares 4 chunks of A
SHARED_CHUNKS = 520 // CHUNK_TOKENS
ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "VLLM_LOGGING_LEVEL": "WARNING"}


def engine_command(model: Path, prompts_file: Path, socket: Path | None, *extra: str) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "tests.vllm.engine_runner",
        "--model",
        str(model),
        "--prompts",
        str(prompts_file),
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        *extra,
    ]
    if socket is not None:
        command += ["--socket", str(socket)]
    return command


def run_engine(
    tmp_path: Path, model: Path, prompts: list[list[int]], socket: Path | None = None, *extra: str
) -> tuple[list[dict], dict]:
    """Generate for each prompt in a fresh engine process: (per-prompt results, connector stats)."""
    prompts_file = tmp_path / f"prompts-{os.urandom(4).hex()}.json"
    prompts_file.write_text(json.dumps(prompts))
    completed = subprocess.run(
        engine_command(model, prompts_file, socket, *extra),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **ENV},
        cwd=Path(__file__).parents[2],
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return parse(completed.stdout)


def parse(stdout: str) -> tuple[list[dict], dict]:
    results = [
        json.loads(line[len(MARK) :]) for line in stdout.splitlines() if line.startswith(MARK)
    ]
    return [r for r in results if "tokens" in r], results[-1].get("connector", {})


def start_engine(tmp_path: Path, model: Path, prompts, socket: Path) -> subprocess.Popen:
    """An engine process that pauses before each prompt after the first (see --pause)."""
    prompts_file = tmp_path / f"prompts-{os.urandom(4).hex()}.json"
    prompts_file.write_text(json.dumps(prompts))
    return subprocess.Popen(
        engine_command(model, prompts_file, socket, "--pause"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **ENV},
        cwd=Path(__file__).parents[2],
    )


def next_result(process: subprocess.Popen) -> dict:
    for line in process.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise AssertionError("engine exited without a result")
