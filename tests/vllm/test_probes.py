"""Background probes of a tier, narrated with a fake agent: a probe reads one chunk off every
request's path, releases its pins as soon as the read returns, and prices the tier in the cost
model; probes are one at a time, a tier at most once per interval; a read that found nothing
measures nothing, one that ran out its timeout says the tier is at least that slow."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from kvstore.connectors.vllm.probes import TierProbes
from kvstore.costmodel import OnlineLoadPlanner


@dataclass
class Loaded:
    payloads: list


@dataclass
class FakeAgent:
    """An agent connection whose loads take `read_s` and bring `arrive` of the keys asked."""

    read_s: float = 0.0
    arrive: int | None = None  # None: every key
    gate: threading.Event = field(default_factory=threading.Event)
    loads: list = field(default_factory=list)
    released: list = field(default_factory=list)

    def call(self, use, otherwise):
        return use(self)

    def load(self, tenant, keys, verify, timeout_s):
        self.loads.append((tenant, list(keys), timeout_s))
        time.sleep(self.read_s)
        self.gate.wait(timeout=5)
        count = len(keys) if self.arrive is None else self.arrive
        return Loaded([b"payload"] * count)

    def release(self, loaded):
        self.released.append(loaded)

    def drop(self):
        pass


def priced_planner() -> OnlineLoadPlanner:
    """A planner that fitted its compute rate (three plain steps), no tier measured yet."""
    planner = OnlineLoadPlanner(chunk_tokens=128, free_tiers=frozenset({"host"}))
    for number, tokens in enumerate((200, 400, 800)):
        planner.step_started([(f"cold-{number}", tokens, 0)], float(number))
        planner.step_ended(number + 0.01 + tokens * 1e-3)
    return planner


def test_a_probe_reads_one_chunk_in_the_background_and_prices_its_tier():
    agent, cost = FakeAgent(read_s=0.05), priced_planner()
    agent.gate.set()
    probes = TierProbes(agent, "tenant-a", cost, interval_s=60)
    assert "disk" not in cost.estimates()[1]
    probe = probes.probe("disk", [b"k0", b"k1"])  # one chunk: two blocks
    assert probe.result(timeout=5) == pytest.approx(0.05, abs=0.04)
    assert agent.loads == [("tenant-a", [b"k0", b"k1"], probes.timeout_s)]
    assert len(agent.released) == 1  # pins released once the read returned
    assert cost.estimates()[1]["disk"] == pytest.approx(0.05, abs=0.04)
    assert probes.stats == {"probes": 1, "probes_measured": 1}
    probes.close()


def test_probes_are_bounded_one_at_a_time_and_a_tier_once_per_interval():
    agent, cost = FakeAgent(), priced_planner()
    probes = TierProbes(agent, "tenant-a", cost, interval_s=60)
    first = probes.probe("disk", [b"k0"])
    assert first is not None
    assert probes.probe("remote", [b"k9"]) is None  # one in flight: never queued behind it
    agent.gate.set()
    first.result(timeout=5)
    assert probes.probe("disk", [b"k1"]) is None  # within the interval
    assert probes.probe("remote", [b"k9"]).result(timeout=5) is not None
    assert len(agent.loads) == 2 and len(agent.released) == 2
    probes.close()


def test_a_chunk_gone_measures_nothing_and_a_timed_out_read_says_slow():
    gone, cost = FakeAgent(arrive=0), priced_planner()
    gone.gate.set()
    probes = TierProbes(gone, "tenant-a", cost, interval_s=0)
    assert probes.probe("disk", [b"k0"]).result(timeout=5) is None  # evicted since the lookup
    assert "disk" not in cost.estimates()[1]
    slow = FakeAgent(read_s=0.1, arrive=0)
    slow.gate.set()
    probes = TierProbes(slow, "tenant-a", cost, interval_s=0, timeout_s=0.1)
    assert probes.probe("remote", [b"k0"]).result(timeout=5) >= 0.1
    assert cost.estimates()[1]["remote"] >= 0.1  # at least the timeout a chunk
    assert cost.chunks_to_load("r", ["remote"] * 2, 600) == 2  # 0.1 s < 0.128 s to compute
    probes.close()
