"""Run-wide test settings. Under .ci/run (KVSTORE_NO_SKIPS=1) a skipped test fails the run:
CI installs every dependency, so a skip there would hide a missing install step. Tests marked
`cuda` (tests/cuda) need a CUDA device: where torch sees none they are deselected, and the run's
summary says how many ("N deselected"), never skipped and never faked on the CPU."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def answer_polls(monkeypatch) -> list[float]:
    """The windows (s) that KVStoreClient calls polled for their answers, in order."""
    from kvstore import framing

    polled: list[float] = []
    spin = framing.spin_until_readable
    monkeypatch.setattr(
        framing,
        "spin_until_readable",
        lambda poller, spin_s: polled.append(spin_s) or spin(poller, spin_s),
    )
    return polled


@pytest.fixture
def cluster_secret_file(tmp_path):
    """A file of the tests' one cluster secret (tests.node.agents gives it to every agent with
    a transfer engine): a NodeConfig with tcp or ucx needs one, or insecure_transfer=True."""
    from tests.node.agents import cluster_secret_file

    return cluster_secret_file(tmp_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # LMCache's tests last: importing LMCache loads numba's llvmlite, whose `lib` object answers
    # any attribute (vars() of it is no dict), and vLLM's in-process engines scan every loaded
    # module's attributes as they start (tests/vllm, tests/plan), failing on it.
    items.sort(key=lambda item: "tests/lmcache/" in item.nodeid)
    if _cuda_device_present():
        return
    deselected = [item for item in items if item.get_closest_marker("cuda")]
    if deselected:
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        config.hook.pytest_deselected(items=deselected)


def _cuda_device_present() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("KVSTORE_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and exitstatus == pytest.ExitCode.OK:
        reporter.write_line(f"\nKVSTORE_NO_SKIPS: {len(skipped)} skipped; CI must run them all")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
