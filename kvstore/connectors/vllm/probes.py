"""Background probes of the tiers the load-or-recompute rule cannot price, or prices as slower
than computing: one chunk read from the tier and timed, off every request's path, so a tier is
measured without a live request loading from it to find out (kvstore.costmodel).

Runs in vLLM's scheduler process: one probe thread with its own agent connection, under the
scheduler's identity and tenant (the agent checks a probe's keys as any load's; a probe reads
only keys a lookup of this tenant just found). Bounded: one chunk per probe, one probe in
flight at a time, a tier probed at most once per `interval_s`, each read given up after
`timeout_s`; a probe's pins are released as soon as its read returns.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvstore.connectors.vllm.agent import AgentConnection
from kvstore.costmodel import OnlineLoadPlanner
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)
PROBE_INTERVAL_S = 5.0  # a tier is probed at most this often (a slow one: how fast it recovers)
PROBE_TIMEOUT_S = 10.0  # a probe's read gives up here: the tier is at least this slow a chunk


class TierProbes:
    """`probe(tier, keys)` from any thread: returns at once; the read runs on the probe thread
    and its time per chunk goes to the cost model. `close` stops it (a read in flight ends
    with its timeout)."""

    def __init__(
        self,
        connection: AgentConnection,
        tenant: str,
        cost: OnlineLoadPlanner,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.connection = connection
        self.tenant = tenant
        self.cost = cost
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-probe")
        self._busy = False  # a probe queued or running (one at a time)
        self._last: dict[str, float] = {}  # tier -> monotonic start of its last probe
        self._lock = threading.Lock()
        self.stats = {"probes": 0, "probes_measured": 0}

    def probe(self, tier: str, block_keys: list[bytes]) -> Future | None:
        """Time a read of `block_keys` (one chunk's blocks, in `tier`) in the background,
        unless a probe is in flight or `tier` was probed within `interval_s`; the probe's
        future (its seconds, or None when the read measured nothing), or None if not started.
        Never blocks."""
        now = time.monotonic()
        with self._lock:
            if self._busy or now - self._last.get(tier, -self.interval_s) < self.interval_s:
                return None
            self._busy, self._last[tier] = True, now
            self.stats["probes"] += 1
        try:
            return self._executor.submit(self._read, tier, block_keys)
        except RuntimeError:  # closed: the connector is shutting down
            return None

    def _read(self, tier: str, block_keys: list[bytes]) -> float | None:
        """On the probe thread: pin, time and release the chunk. A read that brought every
        block, or that ran out its timeout (the tier is at least that slow), prices the tier;
        one that found the chunk gone (evicted since the lookup) or failed measures nothing."""
        try:
            arrived, seconds = self.connection.call(
                lambda client: self._timed_load(client, block_keys), otherwise=(0, 0.0)
            )
        except KVStoreError as exc:
            logger.debug("kvstore probe of the %s tier failed: %s", tier, exc)
            return None
        finally:
            with self._lock:
                self._busy = False
        if arrived < len(block_keys) and seconds < self.timeout_s:
            return None
        self.cost.observe_fetch(tier, 1, seconds)
        with self._lock:
            self.stats["probes_measured"] += 1
        return seconds

    def _timed_load(self, client, block_keys: list[bytes]) -> tuple[int, float]:
        """(blocks that arrived, seconds the load took); the pins are released at once."""
        started = time.perf_counter()
        loaded = client.load(self.tenant, block_keys, verify=False, timeout_s=self.timeout_s)
        seconds = time.perf_counter() - started
        client.release(loaded)
        return len(loaded.payloads), seconds

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.connection.drop()
