"""tests/conftest.py: with KVSTORE_NO_SKIPS=1 (.ci/run sets it) a skipped test fails the run."""

import os
import subprocess
import sys
from pathlib import Path

CONFTEST_PLUGIN = "tests.conftest"
ROOT = Path(__file__).resolve().parent.parent


def run_pytest(test_file: Path, no_skips: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSTORE_NO_SKIPS": no_skips}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", CONFTEST_PLUGIN, str(test_file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_fails_the_run_only_under_ci(tmp_path):
    test_file = tmp_path / "test_one_skip.py"
    test_file.write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\n"
        "def test_missing():\n    pytest.skip('a dependency is missing')\n"
    )
    under_ci = run_pytest(test_file, "1")
    assert under_ci.returncode == 1 and "1 skipped; CI must run them all" in under_ci.stdout
    assert run_pytest(test_file, "0").returncode == 0
