"""Trace replay: push a Mooncake-format trace through a real TieredStore and measure hit ratios.

Runs in the replay process (`kvstore replay`), single-threaded, with one host tier of
`capacity_blocks` pages of placeholder bytes and the named eviction policy.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError
from kvstore.events import EventFeed
from kvstore.eviction import make_policy
from kvstore.eviction.belady import NEVER, BeladyPolicy
from kvstore.keys import BlockKey, Namespace, chunk_key
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers.host import HostTier

TRACE_BLOCK_TOKENS = 512  # Mooncake traces name one hash id per 512-token block
PLACEHOLDER = bytes(16)  # block contents do not matter to hit ratios; eviction is real
PAGE_SIZE_BYTES = HEADER_BYTES + 64
VOCAB_SIZE = 1 << 17
NAMESPACE = Namespace(model_fingerprint="mooncake-trace-replay", layout_id="trace-blocks-512")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival time, prompt length and the ids of its 512-token blocks."""

    timestamp_ms: float
    input_tokens: int
    hash_ids: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens per block: 512 each, the last one holding the remainder."""
        full = [TRACE_BLOCK_TOKENS] * (len(self.hash_ids) - 1)
        return [*full, self.input_tokens - TRACE_BLOCK_TOKENS * len(full)]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a Mooncake JSONL trace in timestamp order; ConfigError names a bad line."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                requests.append(_parse_request(line, f"{path}:{number}"))
    requests.sort(key=lambda request: request.timestamp_ms)  # stable: ties keep file order
    return requests


def _parse_request(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
        request = TraceRequest(
            float(record["timestamp"]),
            int(record["input_length"]),
            tuple(int(hash_id) for hash_id in record["hash_ids"]),
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: missing field {exc} of a Mooncake trace record") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: not a Mooncake trace record ({exc})") from None
    if len(request.hash_ids) != math.ceil(request.input_tokens / TRACE_BLOCK_TOKENS):
        raise ConfigError(
            f"{where}: {len(request.hash_ids)} hash ids for {request.input_tokens} tokens; "
            f"expected one per {TRACE_BLOCK_TOKENS}-token block"
        )
    return request


class TraceKeyer:
    """The project's chained keys for trace blocks, so replay hashes exactly as workers do.

    Block `i` of a request gets 512 token ids expanded from its hash id by SHAKE-128 (stable
    across platforms and library versions; the first n of them for the partial last block), and
    `key_i = chunk_key(key_{i-1}, tokens)`, so equal id prefixes give equal keys. Keys are cached
    per (parent key, hash id, tokens): each distinct block is expanded and hashed once (~20 µs).
    """

    def __init__(self, namespace: Namespace = NAMESPACE) -> None:
        self._root = namespace.root_key()
        self._cache: dict[tuple[bytes, int, int], BlockKey] = {}

    def keys(self, request: TraceRequest) -> list[BlockKey]:
        parent: bytes = self._root
        keys = []
        for hash_id, tokens in zip(request.hash_ids, request.block_tokens(), strict=True):
            parent = self._key(parent, hash_id, tokens)
            keys.append(parent)
        return keys

    def _key(self, parent: bytes, hash_id: int, tokens: int) -> BlockKey:
        cache_key = (parent, hash_id, tokens)
        key = self._cache.get(cache_key)
        if key is None:
            key = self._cache[cache_key] = chunk_key(parent, block_token_ids(hash_id)[:tokens])
        return key


def block_token_ids(hash_id: int) -> np.ndarray:
    """The 512 token ids (int32, below VOCAB_SIZE) standing in for the block named `hash_id`."""
    stream = hashlib.shake_128(hash_id.to_bytes(8, "little", signed=True))
    words = np.frombuffer(stream.digest(4 * TRACE_BLOCK_TOKENS), dtype="<u4")
    return (words & np.uint32(VOCAB_SIZE - 1)).view("<i4")


def next_uses(requests_keys: Sequence[Sequence[BlockKey]]) -> list[list[float]]:
    """For each block of each request, the trace position (global block index) of the next
    request block with the same key, or NEVER. One backward pass."""
    upcoming: dict[BlockKey, float] = {}
    position = sum(len(keys) for keys in requests_keys)
    result: list[list[float]] = []
    for keys in reversed(requests_keys):
        position -= len(keys)
        uses = [upcoming.get(key, NEVER) for key in keys]
        for offset, key in enumerate(keys):
            upcoming[key] = position + offset
        result.append(uses)
    result.reverse()
    return result


@dataclass
class _Tally:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0


def _replay_request(
    store: TieredStore, keys: Sequence[BlockKey], block_tokens: Sequence[int], tally: _Tally
) -> None:
    """Read the longest resident prefix (pin = access, then unpin), then store the rest."""
    hits = store.pin(keys)
    store.unpin(keys[:hits])
    for index in range(hits, len(keys)):
        parent = keys[index - 1] if index else None
        tally.stored_blocks += bool(store.put(keys[index], parent, PLACEHOLDER))
    tally.requests += 1
    tally.blocks += len(keys)
    tally.hit_blocks += hits
    tally.tokens += sum(block_tokens)
    tally.hit_tokens += sum(block_tokens[:hits])


def _progress(items: Iterable, total: int, show: bool, what: str) -> Iterable:
    return tqdm(items, total=total, disable=not show, unit=what, dynamic_ncols=True, leave=False)


def run_replay(trace_path: str, policy: str, capacity_blocks: int, progress: bool) -> dict:
    """Replay `trace_path` through a store of `capacity_blocks` blocks evicting by `policy`.

    A block hits only if it and every block before it in the request are resident (the
    longest resident prefix). Every hash id is a block, the trailing partial one included, as in
    the trace's published figures; token counts give the partial block its real length.
    Raises ConfigError for an unknown policy, capacity_blocks < 1 or a malformed trace.
    """
    if capacity_blocks < 1:
        raise ConfigError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
    evictor = make_policy(policy)
    started = time.perf_counter()
    requests = load_trace(trace_path)
    keyer = TraceKeyer()
    requests_keys = [keyer.keys(r) for r in _progress(requests, len(requests), progress, "req")]
    future = next_uses(requests_keys) if isinstance(evictor, BeladyPolicy) else None
    tally = _Tally()
    host = HostTier(capacity_blocks * PAGE_SIZE_BYTES, PAGE_SIZE_BYTES)
    store = TieredStore([TierSlot(host, evictor)], events=EventFeed(max_events=1))
    try:
        steps = _progress(enumerate(requests), len(requests), progress, "req")
        for number, request in steps:
            keys = requests_keys[number]
            if future is not None:
                for key, position in zip(keys, future[number], strict=True):
                    evictor.set_next_use(key, position)
            _replay_request(store, keys, request.block_tokens(), tally)
    finally:
        store.close()
    return _summary(trace_path, policy, capacity_blocks, tally, time.perf_counter() - started)


def _summary(
    trace: str, policy: str, capacity_blocks: int, tally: _Tally, elapsed_s: float
) -> dict:
    return {
        "trace": str(trace),
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "requests": tally.requests,
        "blocks": tally.blocks,
        "hit_blocks": tally.hit_blocks,
        "block_hit_ratio": tally.hit_blocks / tally.blocks if tally.blocks else 0.0,
        "tokens": tally.tokens,
        "hit_tokens": tally.hit_tokens,
        "token_hit_ratio": tally.hit_tokens / tally.tokens if tally.tokens else 0.0,
        "stored_blocks": tally.stored_blocks,
        "elapsed_s": round(elapsed_s, 3),
    }
