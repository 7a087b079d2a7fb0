"""Two real stores joined by a transfer engine, once per engine; the contract suite runs on each.

"holder" serves its blocks through one engine; "reader" fetches them into reserved pages through
another and verifies them with commit_received, as the node agent does (with the payload
checksums the engine took as the bytes landed, where it takes them). Every engine runs both
without and with a cluster secret (authenticated peers, a MAC on every block).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from kvstore.block import HEADER_BYTES
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey, Namespace, chunk_keys
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier
from kvstore.transfer.base import OpenBlock, TransferEngine, make_engine

ENGINES = ["tcp", "ucx"]
SMALL_PAGE_BYTES = 64 << 10
BIG_PAGE_BYTES = 4 << 20
SECRET = b"transfer-test-cluster-secret-0001"
TENANT = "default"  # the tenant TieredStore.put stores blocks under
LOOPBACK = {"tls": "tcp", "net_devices": "lo"}  # ucx as a cross-host fabric without RDMA uses
KEYS = chunk_keys(Namespace("sha256:transfer-test", "layout"), range(4 * 128), 4)  # 128 keys


@functools.lru_cache(maxsize=256)
def payload(n: int, size_bytes: int) -> bytes:
    """Block `n`'s payload: seeded random bytes, so no run of them recurs in another block."""
    return np.random.default_rng(n).bytes(size_bytes)


def new_store(page_bytes: int, pages: int) -> TieredStore:
    return TieredStore([TierSlot(HostTier(pages * page_bytes, page_bytes), make_policy("lru"))])


def stored_payload(store: TieredStore, key: BlockKey) -> bytes | None:
    with store.read(key) as view:
        return None if view is None else bytes(view.numpy())


class Pair:
    """A holder store served by `server` and a reader store that fetches through `client`."""

    def __init__(self, holder, reader, server, client, wrap=None) -> None:
        self.holder, self.reader = holder, reader
        self.server, self.client = server, client
        self.address = server.serve(
            wrap(holder.open_tenant_block) if wrap else holder.open_tenant_block
        )
        self.checksums: dict[tuple[int, BlockKey], int | None] = {}  # (reader id, key): landed

    def put(self, numbers: Sequence[int], size_bytes: int | None = None) -> list[BlockKey]:
        """Store block `n` (payload(n)) in the holder for each n; returns their keys."""
        size = size_bytes or self.holder.slots[0].tier.page_size_bytes - HEADER_BYTES
        for n in numbers:
            self.holder.put(KEYS[n], None, payload(n, size))
        return [KEYS[n] for n in numbers]

    def fetch(
        self, keys: Sequence[BlockKey], timeout_s: float = 10.0, reader=None, tenant=TENANT
    ) -> list[int]:
        reader = reader or self.reader
        pages = [reader.reserve_page(key) for key in keys]
        checksums = [None] * len(keys)
        received = self.client.fetch(self.address, tenant, keys, pages, timeout_s, checksums)
        self.checksums.update(((id(reader), k), c) for k, c in zip(keys, checksums, strict=True))
        return received

    def land(self, keys: Sequence[BlockKey], received: Sequence[int], reader=None) -> list[bool]:
        reader = reader or self.reader
        checksums = [self.checksums.pop((id(reader), key), None) for key in keys]
        return land(reader, keys, received, checksums)


def land(
    reader: TieredStore,
    keys: Sequence[BlockKey],
    received: Sequence[int],
    checksums: Sequence[int | None] | None = None,
) -> list[bool]:
    """Commit what arrived (verified, against `checksums` where given), abort the rest; True
    per key that became readable."""
    landed = []
    for key, size, checksum in zip(keys, received, checksums or [None] * len(keys), strict=True):
        if size:
            landed.append(reader.commit_received(key, size, checksum))
        else:
            reader.abort(key)
            landed.append(False)
    return landed


@pytest.fixture(params=ENGINES)
def engine_name(request) -> str:
    return request.param


@pytest.fixture(params=[None, SECRET], ids=["open", "secret"])
def cluster_secret(request) -> bytes | None:
    return request.param


@pytest.fixture
def make_transfer_engine(engine_name, cluster_secret) -> Callable[..., TransferEngine]:
    """Builds engines of the parametrised kind and secret; all are closed at teardown."""
    made: list[TransferEngine] = []

    def make(**options) -> TransferEngine:
        options = {"cluster_secret": cluster_secret, **options}
        made.append(make_engine(engine_name, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def make_store() -> Callable[[int, int], TieredStore]:
    made: list[TieredStore] = []

    def make(page_bytes: int = SMALL_PAGE_BYTES, pages: int = 72) -> TieredStore:
        made.append(new_store(page_bytes, pages))
        return made[-1]

    yield make
    for store in made:
        store.close()


@pytest.fixture
def make_pair(make_store, make_transfer_engine) -> Callable[..., Pair]:
    """Engines are closed before the stores (fixture teardown runs in reverse)."""

    def make(
        page_bytes: int = SMALL_PAGE_BYTES,
        pages: int = 72,
        wrap: Callable[[OpenBlock], OpenBlock] | None = None,
    ) -> Pair:
        holder, reader = make_store(page_bytes, pages), make_store(page_bytes, pages)
        return Pair(holder, reader, make_transfer_engine(), make_transfer_engine(), wrap)

    return make


@pytest.fixture
def pair(make_pair) -> Pair:
    return make_pair()


@pytest.fixture
def stores():
    made = [new_store(SMALL_PAGE_BYTES, 16), new_store(SMALL_PAGE_BYTES, 16)]
    yield made
    for store in made:
        store.close()


@pytest.fixture
def make_ucx_pair():
    """Pairs of ucx engines on loopback (options for both); closed, then their stores."""
    from kvstore.transfer.ucx import UcxEngine

    made = []

    def make(page_bytes: int = SMALL_PAGE_BYTES, pages: int = 16, wrap=None, **options) -> Pair:
        options = {**LOOPBACK, **options}
        holder, reader = new_store(page_bytes, pages), new_store(page_bytes, pages)
        made.append(Pair(holder, reader, UcxEngine(**options), UcxEngine(**options), wrap))
        return made[-1]

    yield make
    for pair in made:
        pair.server.close()
        pair.client.close()
        pair.holder.close()
        pair.reader.close()
