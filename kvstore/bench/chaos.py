"""`kvstore bench chaos`: a real cluster on loopback (metadata service, 3 node agents over tcp,
a worker per agent) in which, every 5-10 s (seeded), one process is SIGKILLed and restarted:
an agent, the agent holding the most blocks (a holder mid-transfer), the metadata service, or
a worker mid-operation; `agent-1` is the witness, never killed itself. Workers save and load
prefixes of a window of prefix ids that moves on every 15 s, so saves and remote fetches go on
all run long. Runs in the benchmark process; every other role is a child process.

Workers compare every loaded payload with the bytes its key implies (`wrong_results`, must be
0; a miss is fine). `lost_blocks` counts blocks a worker committed on the *current* incarnation
of an agent (never killed since; always so for the witness) whose disk tier, sized above every
key the run can name (`disk_bytes_for`), never dropped a block and which saw no checksum
failure, and which a local lookup on that agent no longer finds at the end. Commits on a
since-killed incarnation, or on an agent whose disk tier did drop or purge blocks, are
`lost_blocks_excused` (their loss is explained); the blocks checked are `lost_blocks_checked`.
Host-arena evictions only demote to disk, so they excuse nothing. Commits are attributed by
arena name, which carries the agent's pid.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import fields

from kvstore.bench.chaos_worker import (
    CHUNKS,
    PREFIXES,
    SLIDE_PREFIXES,
    TENANT,
    Counts,
    prefix_keys,
)
from kvstore.bench.cluster import (
    Cluster,
    ClusterSpec,
    agent_answers,
    isolate_shm,
    metadata_answers,
    wait_for,
    work_directory,
)
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)
KILL_ROLES = ("agent", "holder", "metadata", "worker")
WITNESS = "agent-1"  # never killed itself (its workers, peers and the service are)
RECOVERY_TIMEOUT_S = 90.0
SLIDE_S = 15.0  # the workers' prefix window moves on: fresh saves, remote fetches all along
MAX_DISK_BYTES = 8 << 30  # sparse LMDB maps; a 10-minute run can name 1.5 GiB of blocks


class Tally:
    """What workers reported, by worker incarnation (thread-safe; fed by the reader threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, int], dict] = {}
        self.first_op_at: dict[tuple[str, int], float] = {}
        self.committed: dict[str, set[tuple[int, int]]] = {}  # arena name -> (prefix, chunk)
        self.wrong: list[dict] = []

    def handle(self, member, incarnation: int, message: dict) -> None:
        kind, slot = message.pop("type", ""), (member.name, incarnation)
        with self._lock:
            if kind == "counts":
                self.counts[slot] = message
                if message["ops"] and slot not in self.first_op_at:
                    self.first_op_at[slot] = time.monotonic()
            elif kind == "committed":
                blocks = self.committed.setdefault(message["arena"], set())
                blocks.update(tuple(block) for block in message["blocks"])
            elif kind == "wrong":
                self.wrong.append({"worker": member.name, **message})
                logger.error("WRONG RESULT from %s: %s", member.name, message)

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {
                f.name: sum(counts.get(f.name, 0) for counts in self.counts.values())
                for f in fields(Counts)
            }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---- one kill ------------------------------------------------------------------------------
def pick_victim(cluster: Cluster, role: str, rng: random.Random) -> str:
    if role == "metadata":
        return "metadata"
    agents = [name for name in cluster.names("agent") if name != WITNESS]
    if role == "holder":
        return _busiest_holder(cluster, agents) or rng.choice(agents)
    return rng.choice(agents if role == "agent" else cluster.names(role))


def _busiest_holder(cluster: Cluster, agents: list[str]) -> str | None:
    """Of `agents`, the one the metadata service says holds the most blocks (peers fetch
    from it)."""
    from kvstore.metadata.client import MetadataClient
    from kvstore.stats import stats_dict

    try:
        with MetadataClient(cluster.metadata_address, timeout_s=2) as client:
            nodes = stats_dict(client.stats())["nodes"]
    except KVStoreError:
        return None
    held = {
        n["node"]["node_id"]: sum(map(int, n.get("blocks_per_tier", {}).values()))
        for n in nodes
        if n["node"]["node_id"] in agents
    }
    return max(held, key=held.get) if held else None


def kill_and_recover(cluster: Cluster, name: str, tally: Tally) -> float | None:
    """SIGKILL `name`, restart it, and return seconds from the kill until it serves again
    (None: not within RECOVERY_TIMEOUT_S)."""
    member = cluster.members[name]
    killed_at = time.monotonic()
    cluster.restart(name)
    if member.role == "agent":
        probe = prefix_keys(cluster.spec.seed, 0)[0]
        served = wait_for(
            lambda: agent_answers(cluster.socket_path(name), probe), RECOVERY_TIMEOUT_S
        )
    elif member.role == "metadata":
        served = wait_for(lambda: metadata_answers(cluster.metadata_address), RECOVERY_TIMEOUT_S)
    else:
        slot = (name, member.incarnation)
        served = wait_for(lambda: slot in tally.first_op_at, RECOVERY_TIMEOUT_S, 0.05)
        if served:
            return tally.first_op_at[slot] - killed_at
    return time.monotonic() - killed_at if served else None


# ---- the end: were committed blocks kept? -------------------------------------------------
def lost_blocks(cluster: Cluster, tally: Tally) -> dict:
    """See the module docstring. Run with the workers stopped and every agent up."""
    from kvstore.client import KVStoreClient

    lost, checked, examples = 0, 0, []
    excused = sum(len(blocks) for blocks in tally.committed.values())
    for agent in cluster.names("agent"):
        try:
            client = KVStoreClient(cluster.socket_path(agent), "chaos-audit")
        except KVStoreError as exc:  # it is not up: its blocks stay excused
            logger.error("cannot audit %s: %s", agent, exc)
            continue
        with client:
            stats = json.loads(client.stats())
            blocks = tally.committed.get(client.info.arena_name, set())
            if stats["evictions"].get("disk", 0) or stats["checksum_failures"]:
                continue
            excused -= len(blocks)
            for prefix, chunk in sorted(blocks):
                key = prefix_keys(cluster.spec.seed, prefix)[chunk]
                checked += 1
                if client.lookup(TENANT, [key], local_only=True).local != 1:
                    lost += 1
                    examples.append({"agent": agent, "prefix": prefix, "chunk": chunk})
    return {
        "lost_blocks": lost,
        "lost_blocks_checked": checked,
        "lost_blocks_excused": excused,
        "lost_examples": examples[:5],
    }


def disk_bytes_for(duration_s: float, page_bytes: int = 1 << 20) -> int:
    """A disk tier for every block the sliding window can name in the run (so that it never
    drops one), capped at MAX_DISK_BYTES (beyond that, drops excuse losses)."""
    prefixes = PREFIXES + SLIDE_PREFIXES * (math.ceil(duration_s / SLIDE_S) + 2)
    return min(MAX_DISK_BYTES, prefixes * CHUNKS * page_bytes)


# ---- the run -------------------------------------------------------------------------------
def run_chaos(
    minutes: float, seed: int = 0, corrupt_worker: str = "", shared_shm: bool = False
) -> dict:
    """Run the chaos benchmark; unless `shared_shm`, in a private /dev/shm (`isolate_shm`:
    call from a process of its own, e.g. the CLI — its main thread keeps that mount)."""
    private_shm = not shared_shm and isolate_shm()
    rng = random.Random(seed)
    tally = Tally()
    kills: Counter[str] = Counter()
    recoveries: dict[str, list[float]] = {}
    crashes: Counter[str] = Counter()
    failed = 0
    with work_directory("kvstore-chaos-") as workdir:
        spec = ClusterSpec(
            workdir,
            minutes * 60,
            seed,
            corrupt_worker=corrupt_worker,
            slide_s=SLIDE_S,
            disk_capacity_bytes=disk_bytes_for(minutes * 60),
        )
        with Cluster(spec, tally.handle) as cluster:
            deadline = cluster.started + spec.duration_s
            logger.info("chaos: cluster up; running %.0f s", spec.duration_s)
            while (wake := time.monotonic() + rng.uniform(5, 10)) < deadline:
                sleep_watching(cluster, wake, crashes)
                role = rng.choice(KILL_ROLES)
                victim = pick_victim(cluster, role, rng)
                logger.info("chaos: killing %s (%s)", victim, role)
                seconds = kill_and_recover(cluster, victim, tally)
                kills[role] += 1
                if seconds is None:
                    failed += 1
                else:
                    recoveries.setdefault(role, []).append(seconds)
            sleep_watching(cluster, deadline, crashes)
            logger.info("chaos: stopping workers, auditing committed blocks")
            stuck = stop_workers(cluster)
            audit = lost_blocks(cluster, tally)
        child_pids = cluster.all_pids()
    every = [s for values in recoveries.values() for s in values]
    return {
        **tally.totals(),
        "operations": tally.totals()["ops"],
        "kills": {role: kills[role] for role in KILL_ROLES},
        "recovery_s_p50": percentile(every, 0.5),
        "recovery_s_p99": percentile(every, 0.99),
        "recovery_s_max_by_role": {role: max(v) for role, v in recoveries.items()},
        "recovery_failures": failed,
        **audit,
        "wrong_examples": tally.wrong[:5],
        "crashes": dict(crashes),
        "stuck_workers": stuck,
        "private_shm": private_shm,
        "child_pids": child_pids,
        "minutes": minutes,
        "seed": seed,
    }


def sleep_watching(cluster: Cluster, until: float, crashes: Counter) -> None:
    """Sleep until `until`, restarting (and counting) any process that exited by itself."""
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
        for name in cluster.exited():
            member = cluster.members[name]
            if member.role == "worker" and member.process.returncode == 0:
                continue  # its run time is over
            logger.error("%s exited by itself; log: %s", name, cluster.log_tail(name))
            crashes[name] += 1
            cluster.restart(name)


def stop_workers(cluster: Cluster) -> dict[str, str]:
    """SIGTERM every worker and wait: each prints its final counts first. Returns the stacks
    of those that did not stop within 30 s (killed then), by name."""

    names = cluster.names("worker")
    for name in names:
        if cluster.members[name].process.poll() is None:
            cluster.members[name].process.send_signal(signal.SIGTERM)
    stuck = {}
    for name in names:
        process = cluster.members[name].process
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a finding: dump its stacks (faulthandler), kill it
            process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            process.kill()
            process.wait()
            stuck[name] = cluster.log_tail(name, 6000)
            logger.error("%s did not stop within 30 s; its stacks: %s", name, stuck[name])
    time.sleep(0.2)  # let the reader threads take the last lines
    return stuck
