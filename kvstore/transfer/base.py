"""The transfer-engine interface: how whole blocks move between node agents on different hosts.

Runs inside the node agent. An engine serves this node's blocks to peers (`serve`) and pulls
peers' blocks into local pages (`fetch`). Blocks travel as stored: 128-byte header + payload;
the receiver verifies the checksum before the block becomes readable (never here). With a
cluster secret, peers authenticate each other and every block carries a MAC (`auth.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, BlockKey

# Yields the whole stored block (header + payload) of a key for a tenant, or None when absent or
# another tenant's (the two must look alike). The view must stay valid, and the block
# un-evicted, until the context exits; it is read outside store locks.
OpenBlock = Callable[[BlockKey, str], AbstractContextManager[torch.Tensor | None]]


@dataclass
class TransferStats:
    """Counters every engine keeps, for tests and metrics."""

    connections_accepted: int = 0  # serving side
    connections_opened: int = 0  # fetching side
    batches_served: int = 0
    transfers_broken: int = 0  # fetches that ended early (peer gone, timeout, protocol error)
    connections_refused: int = 0  # serving side: no handshake or connection slot free
    idle_closed: int = 0  # serving side: idle connections closed to make room for a new peer
    handshakes_dropped: int = 0  # serving side: the oldest handshake, dropped for a newcomer
    handshakes_failed: int = 0  # either side: the peer did not prove the cluster secret
    macs_failed: int = 0  # fetching side: a block whose MAC did not verify (transfer broken)
    batches_cut: int = 0  # serving side: batches dropped at the batch deadline (pins released)


class TransferEngine(ABC):
    """Serves local blocks to peers and fetches peers' blocks. Thread-safe."""

    name: str = ""
    stats: TransferStats

    @abstractmethod
    def serve(self, open_block: OpenBlock, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start answering peers' fetches from `open_block`; returns the address peers dial."""

    @abstractmethod
    def fetch(
        self,
        address: str,
        tenant: str,
        keys: Sequence[BlockKey],
        pages: Sequence[torch.Tensor],
        timeout_s: float,
        checksums: list | None = None,
    ) -> list[int]:
        """Pull `tenant`'s blocks of `keys` from the peer at `address`, block i into `pages[i]`.

        Returns, per key, the bytes received: 0 when the peer lacks the block, or when the
        transfer broke before that block completed (then every later entry is 0 too). Pages
        reported 0 may hold partial bytes and must not be read; once fetch returns nothing
        writes into any page any more, so the caller may free them all. A block another tenant
        owns reads as 0, like an absent one. Raises TransferError only when the peer cannot be
        reached (or, with a cluster secret, authenticated) at all within `timeout_s`.

        `checksums`, if given, is a list as long as `keys`: an engine that hashes blocks as they
        land (tcp, in the same pass as their MAC) sets entry i to the xxh3-64 of the bytes past
        the header that landed in `pages[i]`, for commit_received(payload_checksum=...) to
        compare instead of reading the page again; entries it does not compute are left alone
        (pass Nones: commit_received then hashes the page itself).
        """

    @abstractmethod
    def close(self) -> None:
        """Stop serving and drop connections. Idempotent."""


_ENGINES: dict[str, Callable[..., TransferEngine]] = {}


def register_engine(name: str) -> Callable[[type[TransferEngine]], type[TransferEngine]]:
    def decorate(cls: type[TransferEngine]) -> type[TransferEngine]:
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return decorate


def make_engine(name: str, **options: object) -> TransferEngine:
    """A transfer engine by name ("tcp" or "ucx"); unknown names raise ConfigError."""
    if name == "ucx":
        import kvstore.transfer.ucx
    else:
        import kvstore.transfer.tcp  # noqa: F401
    try:
        return _ENGINES[name](**options)
    except KeyError:
        raise ConfigError(f"unknown transfer engine {name!r}; use 'tcp' or 'ucx'") from None


def check_checksums(engine: str, keys: Sequence[BlockKey], checksums: list | None) -> None:
    if checksums is not None and len(checksums) != len(keys):
        raise ConfigError(f"{engine} fetch got {len(keys)} keys but {len(checksums)} checksums")


def check_fetch_pages(
    engine: str, keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], max_batch_keys: int
) -> None:
    """ConfigError for a misused fetch (caught before any I/O): one page per key, a bounded
    batch of well-formed keys, contiguous uint8 host pages."""
    if len(keys) != len(pages):
        raise ConfigError(f"fetch got {len(keys)} keys but {len(pages)} pages")
    if len(keys) > max_batch_keys or any(len(key) != KEY_BYTES for key in keys):
        raise ConfigError(f"fetch takes at most {max_batch_keys} keys of {KEY_BYTES} bytes")
    if not all(
        p.device.type == "cpu" and p.dtype == torch.uint8 and p.is_contiguous() for p in pages
    ):
        raise ConfigError(f"{engine} engine receives into contiguous uint8 host pages only")
