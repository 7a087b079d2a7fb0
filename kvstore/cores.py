"""Which cores a process's background threads may run on without taking the forward's: the
cores its cgroup allows that no bound thread holds. vLLM's CPU worker binds its OpenMP team
(GOMP_CPU_AFFINITY: libgomp binds the process's first thread as it loads, and every thread
started later inherits that) and leaves the rest of the cpuset to the engine's other
processes and a KV connector's transfers (VLLM_CPU_NUM_OF_RESERVED_CPU). Used in the worker
processes (the connector's load helper, the arena's prefault thread). Linux only; elsewhere
no core is spare.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


@functools.cache
def spare_cpus() -> frozenset[int]:
    """The cores of this process's cpuset that no bound thread holds, found once per process
    (the threads bound to them later are kvstore's own). Empty where no thread is bound (the
    forward's threads may then use every core: a helper would take one from them) or none is
    left free."""
    allowed = cpuset()
    bound = frozenset().union(*(mask for mask in _thread_masks() if mask != allowed))
    return allowed - bound if bound else frozenset()


def cpuset() -> frozenset[int]:
    """The cores this process's cgroup lets it use (cgroup v2, then v1's cpuset controller),
    else the online ones: what its threads' affinities were before anything bound them."""
    for path in _cpuset_files():
        try:
            with open(path) as file:
                return parse_cpu_list(file.read())
        except (OSError, ValueError):
            continue
    return frozenset()


def _cpuset_files() -> list[str]:
    files = []
    try:
        with open("/proc/self/cgroup") as file:
            lines = file.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        path = path.rstrip("/")
        if controllers == "":  # cgroup v2
            files.append(f"/sys/fs/cgroup{path}/cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):
            files.append(f"/sys/fs/cgroup/cpuset{path}/cpuset.effective_cpus")
    return [*files, "/sys/devices/system/cpu/online"]


def parse_cpu_list(text: str) -> frozenset[int]:
    """A kernel CPU list ("0-3,8,10-11") as its cores; ValueError if it names none."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return frozenset(cores)


def _thread_masks() -> list[set[int]]:
    """Each live thread's cores (a thread that ends meanwhile is left out)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    masks = []
    for task in tasks:
        try:
            masks.append(os.sched_getaffinity(int(task)))
        except (OSError, ValueError):
            continue
    return masks


def bind_this_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread on `cpus` only (a thread inherits its starter's binding)."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError) as exc:  # cores gone (a cpuset change); not Linux
        logger.warning("cannot bind thread to cores %s: %s", sorted(cpus), exc)
