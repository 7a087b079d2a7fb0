"""kvstore.cores: the cores a worker's background threads may take, found in a real process
bound the way vLLM's CPU worker binds its OpenMP team, and none where nothing is bound."""

import json
import os
import subprocess
import sys

import pytest

from kvstore.cores import parse_cpu_list

SPARE = """
import json, os, sys
import torch  # libgomp binds this process's first thread as it loads, as in vLLM's worker
from kvstore.cores import cpuset, spare_cpus
torch.ones(64).sum()
print(json.dumps([sorted(cpuset()), sorted(spare_cpus())]))
"""


@pytest.mark.parametrize("bound", [True, False])
def test_spare_cores_are_the_cpusets_that_no_bound_thread_holds_none_where_nothing_is_bound(
    bound,
):
    env = dict(os.environ)
    first = min(os.sched_getaffinity(0))
    env.pop("GOMP_CPU_AFFINITY", None)
    if bound:  # vLLM's CPU worker binds its OpenMP team this way (ompmultiprocessing.py)
        env.update(GOMP_CPU_AFFINITY=str(first), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", SPARE], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    allowed, spare = json.loads(result.stdout)
    assert first in allowed
    assert spare == ([core for core in allowed if core != first] if bound else [])


def test_kernel_cpu_lists_parse_and_an_empty_one_is_refused():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    with pytest.raises(ValueError):
        parse_cpu_list("")
