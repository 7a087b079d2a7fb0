"""The inference-worker stand-in of `bench chaos` and `bench soak`: saves and loads prefixes
through its host's node agent and compares every loaded payload byte for byte with the bytes
its key implies. Runs as `python -m kvstore.bench.chaos_worker`, one process per worker; it
reports JSON lines on stdout (cumulative counts, committed blocks, wrong results).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import hashlib
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace, chunk_key
from kvstore.stop_signals import StopSignals

TENANT = "chaos"
PREFIXES = 48  # a window of 48 prefix ids; every worker saves and loads from the same one
SLIDE_PREFIXES = 8  # with --slide-s, the window moves on by this many every slide_s seconds
CHUNKS = 4  # blocks per prefix
REPORT_EVERY_S = 1.0


# ---- what every process can recompute ----------------------------------------------------
@functools.lru_cache(maxsize=4 * PREFIXES)
def prefix_keys(seed: int, prefix: int) -> tuple[BlockKey, ...]:
    """The chained keys of prefix `prefix` in the key space of `seed`."""
    parent: bytes = Namespace(f"chaos-seed-{seed}", "chaos-layout", tenant=TENANT).root_key()
    keys = []
    for chunk in range(CHUNKS):
        parent = chunk_key(parent, np.array([prefix, chunk], dtype="<i4"))
        keys.append(parent)
    return tuple(keys)


def payload_bytes_of(prefix: int) -> int:
    """Payload size of every block of a prefix: 64 KiB to 512 KiB (one save, one size)."""
    return (64 << 10) * (1 + prefix % 8)


@functools.lru_cache(maxsize=2 * PREFIXES * CHUNKS)
def expected_payload(key: bytes, size_bytes: int) -> np.ndarray:
    """SHAKE-256 of the key, expanded to `size_bytes`: the only correct payload of `key`."""
    return np.frombuffer(hashlib.shake_256(key).digest(size_bytes), dtype=np.uint8)


# ---- one worker --------------------------------------------------------------------------
@dataclass
class Counts:
    ops: int = 0
    lookups: int = 0
    loads: int = 0
    hits: int = 0  # loads that returned at least one block
    blocks_loaded: int = 0
    blocks_remote: int = 0
    saves: int = 0
    blocks_committed: int = 0
    wrong_results: int = 0
    errors: int = 0


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(f"{args.seed}/{args.name}")
        self.counts = Counts()
        self.client = None
        self.corrupt_pending = args.corrupt_expected
        self.stopping = StopSignals()  # SIGTERM or SIGINT, heard without a lock
        self._last_report = 0.0

    def emit(self, kind: str, **fields) -> None:
        print(json.dumps({"type": kind, **fields}), flush=True)

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            self.emit("counts", **asdict(self.counts))

    def connect(self) -> None:
        from kvstore.client import KVStoreClient

        while self.client is None and not self.stopping.is_set():
            try:
                self.client = KVStoreClient(self.args.socket, self.args.name, timeout_s=15)
            except KVStoreError:
                self.counts.errors += 1
                self.stopping.wait(0.2)

    def step(self) -> None:
        slide_s = self.args.slide_s
        window = int(time.time() // slide_s) * SLIDE_PREFIXES if slide_s else 0  # same clock
        prefix = window + self.rng.randrange(PREFIXES)
        keys = list(prefix_keys(self.args.seed, prefix))[: self.rng.randint(1, CHUNKS)]
        roll = self.rng.random()
        if roll < self.args.save_fraction:
            self.save(prefix, keys)
        elif roll < self.args.save_fraction + 0.15:
            self.client.lookup(TENANT, keys)
            self.counts.lookups += 1
        else:
            self.load(prefix, keys)
        self.counts.ops += 1

    def save(self, prefix: int, keys: list[BlockKey]) -> None:
        size = payload_bytes_of(prefix)
        reservation = self.client.save(TENANT, keys, size)
        written = []
        for chunk, (key, view) in enumerate(zip(keys, reservation.payloads, strict=True)):
            if view is not None:
                view.numpy()[:] = expected_payload(key, size)
                written.append([prefix, chunk])
        committed = self.client.commit(reservation)
        self.counts.saves += 1
        self.counts.blocks_committed += committed
        if committed:
            self.emit("committed", arena=self.client.info.arena_name, blocks=written)

    def load(self, prefix: int, keys: list[BlockKey]) -> None:
        loaded = self.client.load(TENANT, keys, timeout_s=3.0)
        try:
            for chunk, view in enumerate(loaded.payloads):
                self.check(prefix, chunk, keys[chunk], view.numpy())
        finally:
            self.client.release(loaded)
        self.counts.loads += 1
        self.counts.hits += bool(len(loaded))
        self.counts.blocks_loaded += len(loaded)
        self.counts.blocks_remote += loaded.remote_blocks

    def check(self, prefix: int, chunk: int, key: bytes, payload: np.ndarray) -> None:
        expected = expected_payload(key, payload_bytes_of(prefix))
        if self.corrupt_pending:  # test-only: prove that a mismatch is detected
            expected = expected.copy()
            expected[len(expected) // 2] ^= 0xFF
            self.corrupt_pending = False
        if payload.shape == expected.shape and np.array_equal(payload, expected):
            return
        self.counts.wrong_results += 1
        self.emit(
            "wrong",
            prefix=prefix,
            chunk=chunk,
            key=key.hex(),
            size=int(payload.size),
            expected_size=int(expected.size),
            agent=self.client.info.node_id,
        )
        self.report(force=True)

    def run(self) -> None:
        deadline = time.monotonic() + self.args.duration_s
        period_s = 1.0 / self.args.ops_per_s
        self.connect()
        # At least one operation, so that a worker restarted near the end still shows it serves.
        while (time.monotonic() < deadline or not self.counts.ops) and self.client is not None:
            started = time.monotonic()
            try:
                self.step()
            except KVStoreError:
                self.counts.errors += 1
                if self.client.broken:
                    self.client.close()  # unmaps the dead agent's arena
                    self.client = None
                    self.connect()
            self.report(force=self.counts.ops == 1)
            if self.stopping.is_set():
                break
            self.stopping.wait(max(0.0, period_s - (time.monotonic() - started)))
        self.report(force=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.chaos_worker")
    parser.add_argument("--name", required=True)
    parser.add_argument("--socket", required=True, help="unix socket of this host's agent")
    parser.add_argument("--seed", type=int, default=0, help="key space (same in every worker)")
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--ops-per-s", type=float, default=20.0)
    parser.add_argument("--save-fraction", type=float, default=0.35)
    parser.add_argument(
        "--slide-s",
        type=float,
        default=0.0,
        help="move the prefix window every SLIDE_S seconds (0: fixed)",
    )
    parser.add_argument(
        "--corrupt-expected",
        action="store_true",
        help="test only: flip one byte of one expected payload",
    )
    return parser


def main() -> int:
    worker = Worker(_parser().parse_args())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a worker that hangs
    with worker.stopping:
        worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
