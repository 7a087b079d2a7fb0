"""The progress bar of `kvstore plan`: a few redraws a second on stderr, silent off a terminal
unless forced, counts that end at the total, and stdout that stays one JSON object."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.plan.model import load_model
from kvstore.plan.options import PlanOptions
from kvstore.plan.progress import Progress, progress_bar
from kvstore.plan.run import Planner
from kvstore.plan.traces import read_trace
from tests.plan.traces import write_mooncake

GIB = 1 << 30


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_redraws_at_most_once_per_interval():
    clock, stream = FakeClock(), io.StringIO()
    bar = Progress(stream, 10_000, "req", interval_s=0.25, clock=clock)
    for _ in range(5_000):
        bar.advance()
    assert stream.getvalue().count("\r") == 1  # the first advance draws, the rest wait
    clock.now_s += 0.3
    bar.advance()
    assert stream.getvalue().count("\r") == 2
    bar.close()
    bar.advance()  # after close: counted, never drawn
    assert stream.getvalue().count("\r") == 3 and stream.getvalue().endswith("\n")


def test_the_line_shows_the_count_share_rate_and_eta():
    clock = FakeClock()
    bar = Progress(io.StringIO(), 1_000, "req", clock=clock)
    bar.start(1_000, "config 2/4")
    clock.now_s += 10.0
    bar.advance(250)
    line = bar.line()
    assert line.startswith("config 2/4: 250/1,000 req  25%  25 req/s")
    assert "eta 0:30" in line and "elapsed 0:10" in line
    clock.now_s += 990.0  # a slow stage keeps its rate's digits
    assert "  0.25 req/s  eta 50:00  elapsed 16:40" in bar.line()


def test_auto_is_silent_off_a_terminal_and_always_is_not():
    for mode, stream, shown in (
        ("auto", io.StringIO(), False),
        ("auto", Terminal(), True),
        ("always", io.StringIO(), True),
        ("never", Terminal(), False),
    ):
        bar = progress_bar(mode, 3, "req", stream)
        bar.advance()
        bar.close()
        assert bool(stream.getvalue()) is shown, mode
    with pytest.raises(ConfigError, match="--progress"):
        progress_bar("sometimes", 3, "req")


def test_the_planner_counts_every_pass_to_its_total(tmp_path):
    trace = read_trace(write_mooncake(tmp_path / "trace.jsonl", requests=120))
    options = PlanOptions(dram_bytes=(0, 4 * GIB), nvme_bytes=(0, 16 * GIB))
    stream = io.StringIO()
    bar = progress_bar("always", 0, "req", stream)
    Planner(trace, load_model("llama-3-8b"), options, bar).run()
    # keys, 6 distinct stores (2 codecs x 3 non-empty sizes), 8 costings: 15 passes
    assert bar.total == 120 * 15 and bar.done == bar.total
    assert "\rconfig 8/8: 1,800/1,800 req 100%" in stream.getvalue()


def test_validation_counts_every_prompt_it_runs():
    outputs = [SimpleNamespace(num_cached_tokens=n) for n in (0, 64, 128)]

    class FakeEngine:
        def generate(self, prompt, params, use_tqdm):
            return [outputs[len(prompt["prompt_token_ids"]) - 1]]

    from kvstore.plan.validate import Run, _measure

    runs = [Run("trace", [7] * n, None) for n in (1, 2, 3)]
    stream = io.StringIO()
    measured = _measure(FakeEngine(), runs, progress_bar("always", 0, "prompt", stream))
    assert measured["cached_tokens"].tolist() == [0, 64, 128]
    assert "validate: 3/3 prompt 100%" in stream.getvalue()


def test_json_stays_one_object_on_stdout_with_the_bar_forced_on_stderr(tmp_path):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=80)
    argv = ["plan", trace, "--tiers", "dram=0,8GiB;nvme=0", "--json", "--progress", "always"]
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, timeout=120
    )
    stdout, stderr = done.stdout.decode(), done.stderr.decode()  # bytes: keep the \r
    assert done.returncode == 0, stderr
    assert stdout.count("\n") == 1 and json.loads(stdout)["requests"] == 80
    assert "\rconfig 4/4: 560/560 req 100%" in stderr and stderr.endswith("\n")


def test_auto_leaves_a_captured_stderr_without_a_bar(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "trace.jsonl", requests=80)
    assert main(["plan", trace, "--tiers", "dram=0,8GiB;nvme=0", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["requests"] == 80
    assert "\r" not in captured.err
