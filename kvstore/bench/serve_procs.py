"""The child processes of `kvstore bench serve`: OpenAI servers (vLLM's api_server), the stores
behind them, and vLLM's own serving-benchmark client; HTTP helpers to wait on, warm up and
scrape a server. Runs in the benchmark process; every child logs to its own file, never to the
benchmark's stdout (which carries only the JSON).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_SERVER_DEV_MODE": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    # vLLM's CPU worker leaves one core to its scheduler process, two with a KV connector;
    # where it cannot leave two (a 2-core host) it leaves none, so connector servers computed
    # on every core and the baseline on one less: one core left in every mode
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
_CLIENT_CODE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser;"
    " from vllm.benchmarks.serve import add_cli_args, main;"
    " parser = FlexibleArgumentParser(); add_cli_args(parser);"
    " main(parser.parse_args(sys.argv[1:]))"
)


def free_port() -> int:
    """A loopback port free now (the child binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Child:
    """One child process, its stdout and stderr in `log_path`; `start_s` is how long it took
    from spawn until `ready()` first held."""

    def __init__(self, name: str, process: subprocess.Popen, log, started_s: float) -> None:
        self.name = name
        self.process = process
        self.log_path = Path(log.name)
        self.start_s: float | None = None
        self._log = log
        self._started = started_s

    @classmethod
    def spawn(cls, name: str, command: list[str], log_path: Path, env: dict) -> Child:
        """Start `command` in a session of its own (stop ends its whole process group)."""
        log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        started_s = time.perf_counter()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **VLLM_ENV, **env},
            start_new_session=True,
        )
        return cls(name, process, log, started_s)

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> float:
        deadline = self._started + timeout_s
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.process.returncode}): {self.tail()}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s} s: {self.tail()}")
            time.sleep(0.1)
        self.start_s = time.perf_counter() - self._started
        logger.info("%s ready in %.1f s (log %s)", self.name, self.start_s, self.log_path)
        return self.start_s

    def logged(self, text: str) -> bool:
        return text in self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM to its process group (vLLM's engine core is its child), then SIGKILL."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def post_json(url: str, body: dict, timeout_s: float = 300.0) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else {}


def scrape(base_url: str) -> dict[str, float]:
    """The server's Prometheus samples, `name{labels}` -> value (its own counters only)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def counter(samples: dict[str, float], name: str, label: str = "") -> float:
    """Sum of `name`'s samples (over engines), those carrying `label` (k="v") only if given."""
    return sum(
        value
        for key, value in samples.items()
        if key.split("{", 1)[0] == name and (not label or label in key)
    )


def has_metric(samples: dict[str, float], name: str) -> bool:
    return any(key.split("{", 1)[0] == name for key in samples)


def run_client(args: list[str], log_path: Path, result_path: Path) -> dict:
    """vLLM's serving benchmark (vllm.benchmarks.serve) as a child; its saved result JSON."""
    command = [
        sys.executable,
        "-c",
        _CLIENT_CODE,
        *args,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_path.parent),
        "--result-filename",
        result_path.name,
    ]
    with open(log_path, "a") as log:
        completed = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **VLLM_ENV},
            timeout=3600,
        )
    if completed.returncode != 0:
        raise RuntimeError(f"the benchmark client failed: {log_path.read_text()[-3000:]}")
    return json.loads(result_path.read_text())
