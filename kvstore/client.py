"""The client API connectors use: a unix-socket control channel to the host's node agent plus
the agent's shared arena, mapped here, for zero-copy reads and writes of block payloads.

Runs inside inference workers (the vLLM / SGLang connector). One client per process half is
the rule; it is thread-safe (calls are serialised) and offers futures (`*_async`) so a
connector can overlap loads with compute. Calls may also be pipelined: a call sent without
waiting (`release(wait=False)`, `save_sent`) has its answer read before the next call's (the
agent answers in order), so a worker pays no round trip for an answer it does not need yet.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from kvstore import errors, framing
from kvstore.block import payload_checksum
from kvstore.config import read_secret_file
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import Hasher, copy_hashed
from kvstore.metadata import status
from kvstore.tier import ANSWER_NAMES, BY_CODE
from kvstore.tiers.host import MappedBuffer, map_fd
from kvstore.v1 import agent_pb2 as pb

logger = logging.getLogger(__name__)
DEFAULT_ANSWER_SPIN_US = 100  # a lookup's answer comes in 30-50 us (docs/view.md)
MAX_ANSWER_SPIN_US = 10_000  # past this, polling burns a core for nothing a sleep would lose
MAX_CALLS_SENT = 64  # calls sent and not answered yet; one more first reads the oldest answer


def check_answer_spin_us(value: int) -> None:
    """`answer_spin_us`, refused outside [0, MAX_ANSWER_SPIN_US] (the connectors check it when
    their settings are read, before any connection)."""
    if not 0 <= value <= MAX_ANSWER_SPIN_US:
        raise errors.ConfigError(
            f"answer_spin_us must be in [0, {MAX_ANSWER_SPIN_US}] "
            f"(0: sleep for each answer at once), got {value}"
        )


def _error(error: pb.AgentError) -> errors.KVStoreError:
    """The agent's error as the kvstore error of its status (metadata/status.py's one table)."""
    code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)
    return status.error_for(code, error.message)


TIERS = ANSWER_NAMES  # where a looked-up key is, nearest first
TIER_OF_CODE = {code: answer.name for code, answer in BY_CODE.items()}  # LookupCounts.codes


@dataclass(frozen=True)
class LookupCounts:
    local: int  # leading keys in this host's tiers
    remote: int  # further leading keys that other nodes hold
    codes: str = field(default="", compare=False)  # per leading key: a TIER_OF_CODE key

    @property
    def total(self) -> int:
        return self.local + self.remote

    def tier_names(self) -> tuple[str, ...]:
        """Where each of the `total` leading keys is; an agent that does not say (older than
        the field) has its local keys read as host."""
        if len(self.codes) == self.total:
            return tuple(TIER_OF_CODE.get(code, "host") for code in self.codes)
        return ("host",) * self.local + ("remote",) * self.remote


@dataclass
class _Sent:
    """A call sent to the agent whose answer is not read yet (answers come in order)."""

    request_id: int
    name: str
    kept: bool  # someone will ask for the answer; else it is read, checked and dropped
    response: pb.AgentResponse | None = None


@dataclass
class LoadedBlocks:
    """The loaded prefix's payloads, as views into this worker's mapping (pinned arena pages,
    or private copies): read them in place, then `release`. len(payloads) may be shorter
    than the keys asked for."""

    load_id: int
    payloads: list[torch.Tensor]
    checksums: list[int]
    local_blocks: int
    remote_blocks: int

    def __len__(self) -> int:
        return len(self.payloads)

    def copy_to(self, index: int, destination: torch.Tensor) -> bool:
        """Copy payload `index` into `destination` (flat uint8, host memory), hashing the copy
        as it is made: False when the copy is not the block that was loaded (its page changed
        meanwhile): then `destination` must be treated as a miss. One pass over the bytes."""
        hasher = Hasher()
        copy_hashed(destination, self.payloads[index], hasher)
        return hasher.intdigest() == self.checksums[index]


@dataclass
class SaveReservation:
    """Writable payload views for the keys that were reserved (None: skip that key)."""

    save_id: int
    keys: list[BlockKey]
    payloads: list[torch.Tensor | None]

    def reserved_keys(self) -> list[BlockKey]:
        return [k for k, view in zip(self.keys, self.payloads, strict=True) if view is not None]


class KVStoreClient:
    """A worker's connection to its node agent. `credential_file` holds a token the agent's
    worker-credentials file maps to tenants; without it the agent goes by this process's uid
    and gid (SO_PEERCRED). `pin_mapping`: register the mapping with CUDA (page-locked, so
    copies to a device are DMA); off for processes that never copy payloads (a scheduler).
    `answer_spin_us`: how long a call polls for the agent's answer before sleeping on it (a
    lookup is answered in tens of microseconds, less than two wakeups cost on a VM; 0: sleep
    at once, for hosts whose cores are too few to burn any)."""

    def __init__(
        self,
        socket_path: str | Path,
        worker: str = "",
        timeout_s: float = 30.0,
        credential_file: str | Path | None = None,
        pin_mapping: bool = True,
        answer_spin_us: int = DEFAULT_ANSWER_SPIN_US,
    ) -> None:
        check_answer_spin_us(answer_spin_us)
        credential = (
            read_secret_file(Path(credential_file), "worker credential")
            if (credential_file)
            else ""
        )
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(socket_path))
        except OSError as exc:
            self._sock.close()
            raise errors.UnavailableError(f"no node agent at {socket_path}: {exc}") from None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sent: deque[_Sent] = deque()  # in the order the agent answers them
        self._broken = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-client")
        self._pin_mapping = pin_mapping
        self._answer_spin_s = answer_spin_us / 1e6
        self._answer_poll = select.poll()
        self._answer_poll.register(self._sock, select.POLLIN)
        try:
            self.info = self._call("hello", worker=worker, credential=credential).hello
            self._mapping = self._receive_mapping()
        except BaseException:
            self._executor.shutdown(wait=False)
            self._sock.close()
            raise
        self.header_bytes = self.info.header_bytes

    def _receive_mapping(self) -> MappedBuffer:
        """Map the descriptor the agent sends after its hello (the arena, or this worker's
        private buffer: `info.access` says which)."""
        try:
            _, fds, _, _ = socket.recv_fds(self._sock, 1, 1)
        except OSError as exc:
            raise errors.UnavailableError(f"the node agent sent no mapping: {exc}") from None
        if len(fds) != 1:
            raise errors.UnavailableError("the node agent sent no mapping after its hello")
        try:
            return map_fd(fds[0], self.info.mapping_bytes, pin=self._pin_mapping)  # CUDA DMA
        finally:
            os.close(fds[0])

    @property
    def access(self) -> str:
        """Either "shared" (payload views are arena pages) or "private" (copies of its own)."""
        return self.info.access

    # ---- protocol --------------------------------------------------------------------------
    def _call(self, name: str, **fields) -> pb.AgentResponse:
        """One request and its answer; `fields` are those of the `name` call's message (one
        message built from a dict: a lookup pays no copy)."""
        return self._answer(self._send_call(name, fields, kept=True))

    def _call_or_send(self, name: str, fields: dict, wait: bool) -> None:
        """`name`'s call, answered now (`wait`), or sent, its answer read by the next call."""
        if wait:
            self._call(name, **fields)
        else:
            self._send_call(name, fields, kept=False)

    def _send_call(self, name: str, fields: dict, kept: bool) -> _Sent:
        """Send a call without reading its answer (`_answer` reads it; unless `kept`, the
        next call reads it, and only logs an error it carries)."""
        request = pb.AgentRequest(request_id=next(self._ids), **{name: fields})
        with self._lock:
            if len(self._sent) >= MAX_CALLS_SENT:
                self._read_until(self._sent[0])
            self._require_open()
            try:
                refusal = self._send(request)
            except (OSError, errors.KVStoreError) as exc:
                self._break()
                raise errors.UnavailableError(f"node agent connection failed: {exc}") from None
            sent = _Sent(request.request_id, name, kept, refusal)
            if refusal is None:
                self._sent.append(sent)
            else:
                self._break()  # the agent refused this connection; its refusal is the answer
            return sent

    def _answer(self, sent: _Sent) -> pb.AgentResponse:
        """The answer of a call sent with `kept`; its error raised as a KVStoreError."""
        with self._lock:
            if sent.response is None:
                self._read_until(sent)
        response = sent.response
        if response.HasField("error"):
            raise _error(response.error)
        return response

    def _read_until(self, sent: _Sent) -> None:
        """Under the lock: read answers in order up to `sent`'s, keeping the kept ones."""
        while sent.response is None:
            self._require_open()
            head = self._sent[0]
            try:
                if self._answer_spin_s:
                    framing.spin_until_readable(self._answer_poll, self._answer_spin_s)
                response = framing.recv_message(self._sock, pb.AgentResponse)
            except (OSError, errors.KVStoreError) as exc:
                self._break()  # a late answer must never be read as the next call's
                raise errors.UnavailableError(f"node agent connection failed: {exc}") from None
            if response is None or response.request_id != head.request_id:
                self._break()
                if response is not None and response.HasField("error"):
                    raise _error(response.error)  # the agent refused this connection
                raise errors.UnavailableError(
                    "the node agent closed or desynchronised the connection"
                )
            self._sent.popleft()
            head.response = response
            if not head.kept and response.HasField("error"):
                logger.warning("kvstore %s failed: %s", head.name, response.error.message)

    def _require_open(self) -> None:
        if self._broken:
            raise errors.UnavailableError("this client's agent connection broke; reconnect")

    def _send(self, request: pb.AgentRequest) -> pb.AgentResponse | None:
        """Send; None, unless the agent already refused this connection: then its refusal,
        waiting to be read, is returned as the answer (a bare broken pipe would hide why)."""
        try:
            framing.send_message(self._sock, request)
        except (BrokenPipeError, ConnectionResetError):
            refusal = framing.recv_message(self._sock, pb.AgentResponse)
            if refusal is None or not refusal.HasField("error"):
                raise
            return refusal
        return None

    def _break(self) -> None:
        self._broken = True
        self._sock.close()

    @property
    def broken(self) -> bool:
        """True once the connection failed: make a new client."""
        return self._broken

    def _payload_view(self, offset: int, payload_bytes: int) -> torch.Tensor:
        return self._mapping.flat[offset : offset + payload_bytes]

    # ---- reads -----------------------------------------------------------------------------
    def lookup(
        self, tenant: str, keys: Sequence[bytes], local_only: bool = False, chunk_tokens: int = 0
    ) -> LookupCounts:
        """How many leading `keys` can be loaded (local tiers, then other nodes) and where each
        is (`codes`, `tier_names`); no side effect. `chunk_tokens`: the prompt tokens each key
        stands for, which the agent's and the metadata service's token hit counters add up."""
        result = self._call(
            "lookup", tenant=tenant, keys=keys, local_only=local_only, chunk_tokens=chunk_tokens
        ).lookup
        codes = result.tiers.decode("ascii", "replace")
        return LookupCounts(result.local_hits, result.remote_hits, codes)

    def load(
        self, tenant: str, keys: Sequence[bytes], timeout_s: float = 0.0, verify: bool = True
    ) -> LoadedBlocks:
        """Pin the longest loadable prefix of `keys` in the arena (fetching remote blocks).

        With `verify`, each payload's checksum is checked here, in this process; the prefix
        ends before the first block that fails (it is then a miss, recomputed by the engine).
        A consumer that copies the payloads out should pass verify=False and copy with
        `LoadedBlocks.copy_to`, which verifies the copy itself in the same pass.
        """
        loaded = self.load_sent(tenant, keys, timeout_s)()
        if verify:
            good = next(
                (
                    i
                    for i, (view, expected) in enumerate(
                        zip(loaded.payloads, loaded.checksums, strict=True)
                    )
                    if payload_checksum(view) != expected
                ),
                len(loaded),
            )
            del loaded.payloads[good:], loaded.checksums[good:]
        return loaded

    def load_sent(
        self, tenant: str, keys: Sequence[bytes], timeout_s: float = 0.0
    ) -> Callable[[], LoadedBlocks]:
        """`load` (unverified), sent now; the returned function waits for its answer, on any
        thread (a call made meanwhile reads this one's answer first, and keeps it)."""
        fields = {"tenant": tenant, "keys": keys, "timeout_ms": int(timeout_s * 1000)}
        sent = self._send_call("load", fields, kept=True)
        return lambda: self._loaded(self._answer(sent).load)

    def _loaded(self, result) -> LoadedBlocks:
        payloads = [
            self._payload_view(offset, size)
            for offset, size in zip(result.offsets, result.payload_bytes, strict=True)
        ]
        return LoadedBlocks(
            result.load_id,
            payloads,
            list(result.checksums),
            result.local_blocks,
            result.remote_blocks,
        )

    def load_async(self, tenant: str, keys: Sequence[bytes], **options) -> Future[LoadedBlocks]:
        return self._executor.submit(self.load, tenant, keys, **options)

    def release(self, loaded: LoadedBlocks, suspect: Sequence[int] = (), wait: bool = True) -> None:
        """Unpin a load. Its payload views must not be read afterwards. `suspect`: positions
        of payloads whose copy failed its checksum (the agent purges them if corrupt).
        Without `wait`, the answer is read (and an error only logged) by the next call."""
        self._call_or_send("release", {"load_id": loaded.load_id, "suspect": suspect}, wait)

    # ---- writes ----------------------------------------------------------------------------
    def save(
        self, tenant: str, keys: Sequence[bytes], payload_bytes: int, **options
    ) -> SaveReservation:
        """Reserve arena pages for a chain of chunk keys; write payloads in place, then commit.
        `options`: save_sent's (first_parent, layout_hash, codec_id)."""
        return self.save_sent(tenant, keys, payload_bytes, **options)()

    def save_sent(
        self,
        tenant: str,
        keys: Sequence[bytes],
        payload_bytes: int,
        first_parent: bytes | None = None,
        layout_hash: int = 0,
        codec_id: int = 0,
    ) -> Callable[[], SaveReservation]:
        """`save`, sent now; the returned function waits for its answer (a call made
        meanwhile reads this one's answer first, and keeps it)."""
        fields = {
            "tenant": tenant,
            "keys": keys,
            "first_parent": first_parent or b"",
            "payload_bytes": payload_bytes,
            "layout_hash": layout_hash,
            "codec_id": codec_id,
        }
        sent = self._send_call("save", fields, kept=True)
        return lambda: self._reservation(self._answer(sent).save, keys, payload_bytes)

    def _reservation(self, result, keys: Sequence[bytes], payload_bytes: int) -> SaveReservation:
        views = [
            self._payload_view(offset, payload_bytes) if reserved else None
            for reserved, offset in zip(result.reserved, result.offsets, strict=True)
        ]
        return SaveReservation(result.save_id, [BlockKey(k) for k in keys], views)

    def commit(
        self,
        reservation: SaveReservation,
        keys: Sequence[bytes] | None = None,
        checksums: Sequence[int] = (),
    ) -> int:
        """Make written payloads readable (all reserved keys by default); returns how many."""
        keys = reservation.reserved_keys() if keys is None else list(keys)
        return self._call(
            "commit", save_id=reservation.save_id, keys=keys, checksums=checksums
        ).commit.committed

    def commit_async(self, reservation: SaveReservation, **options) -> Future[int]:
        return self._executor.submit(self.commit, reservation, **options)

    def abort(self, reservation: SaveReservation, wait: bool = True) -> None:
        """Free every page of the reservation that was not committed. Without `wait`, the
        answer is read (and an error only logged) by the next call."""
        self._call_or_send("abort", {"save_id": reservation.save_id}, wait)

    def stats(self) -> str:
        return self._call("stats").stats.json

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._sock.close()
        self._mapping.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
