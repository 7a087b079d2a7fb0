"""RemoteFetcher over real stores, with a stand-in transfer engine and view (this layer only;
the real agents and engines are in test_slow_disk.py and test_multinode.py): a load that
loses the race for a block's reservation to another load waits for that load's copy instead
of ending its prefix there."""

import threading

import torch

from kvstore.eviction import make_policy
from kvstore.keys import Namespace, chunk_keys
from kvstore.node.remote import RemoteFetcher
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers import HostTier

PAGE = 1024
KEYS = chunk_keys(Namespace("sha256:fetch-join", "layout"), range(12), 4)


def host_store(pages: int = 8) -> TieredStore:
    return TieredStore([TierSlot(HostTier(pages * PAGE, PAGE), make_policy("lru"))])


class HolderEngine:
    """Copies blocks out of `holder` as a peer's engine would; records what it was asked."""

    name = "tcp"

    def __init__(self, holder: TieredStore) -> None:
        self.holder = holder
        self.fetched: list[bytes] = []

    def fetch(self, address, tenant, keys, pages, timeout_s, checksums):
        self.fetched.extend(keys)
        return [copy_block(self.holder, key, page) for key, page in zip(keys, pages, strict=True)]


class EveryKeyOnTheHolder:
    """A view that names one holder for every key (and takes corrections silently)."""

    def plan(self, tenant, keys, ucx):
        return [("holder", "127.0.0.1:1")] * len(keys)

    def forget(self, tenant, keys, node_id):
        pass

    def learn_addresses(self, addresses):
        pass


def copy_block(holder: TieredStore, key: bytes, page: torch.Tensor) -> int:
    with holder.open_block(key) as data:
        if data is None:
            return 0
        page[: data.numel()].copy_(data)
        return data.numel()


def test_a_load_that_loses_the_race_for_a_reservation_waits_for_the_winner():
    holder, reader = host_store(), host_store()
    for index, key in enumerate(KEYS):
        holder.put(key, KEYS[index - 1] if index else None, bytes([index + 1]) * 500)
    engine = HolderEngine(holder)
    fetcher = RemoteFetcher(reader, None, engine, "reader", EveryKeyOnTheHolder())
    checked = reader.await_arrival

    def then_another_load_reserves(key, timeout_s):
        """KEYS[0] is found neither stored nor on its way; right after, another load
        reserves it and commits it 0.2 s later."""
        answer = checked(key, timeout_s)
        if key == KEYS[0] and not engine.fetched and (page := reader.reserve_page(key)) is not None:
            size = copy_block(holder, key, page)
            threading.Timer(0.2, reader.commit_received, (key, size)).start()
        return answer

    reader.await_arrival = then_another_load_reserves
    try:
        assert fetcher.fetch("default", KEYS, timeout_s=5) == len(KEYS)
        assert engine.fetched == KEYS[1:], "the winner's block is not fetched twice"
        with reader.open_block(KEYS[0]) as block:
            assert block is not None
    finally:
        holder.close()
        reader.close()
