"""The TransferEngine contract, narrated, against every engine (tcp, ucx): blocks arrive whole
or not at all, misses and failures read as 0, a corrupt block never becomes readable, and
timeouts, closes and concurrent fetches behave."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError, TransferError
from tests.transfer.conftest import (
    BIG_PAGE_BYTES,
    KEYS,
    SMALL_PAGE_BYTES,
    TENANT,
    payload,
    stored_payload,
)


def pins_drain(store, within_s: float = 2.0) -> bool:
    """Whether the holder's pins reach 0 soon (a server may unpin just after the last send)."""
    deadline = time.monotonic() + within_s
    while store.pins_held() and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.pins_held() == 0


def block_bytes(pair, n: int) -> bytes:
    size = pair.holder.slots[0].tier.page_size_bytes - HEADER_BYTES
    return payload(n, size)


@pytest.mark.parametrize("page_bytes", [SMALL_PAGE_BYTES, BIG_PAGE_BYTES], ids=["64KiB", "4MiB"])
def test_a_batch_of_blocks_arrives_byte_identical(make_pair, page_bytes):
    pair = make_pair(page_bytes, pages=9)
    keys = pair.put(range(8))

    received = pair.fetch(keys)

    assert received == [page_bytes] * 8
    assert pair.land(keys, received) == [True] * 8
    assert all(stored_payload(pair.reader, KEYS[n]) == block_bytes(pair, n) for n in range(8))
    assert pair.reader.checksum_failures == 0


def test_missing_keys_read_as_zero_and_the_rest_still_arrive(pair):
    pair.put([0, 2, 3, 6])
    keys = KEYS[:8]

    received = pair.fetch(keys)

    assert [bool(size) for size in received] == [n in (0, 2, 3, 6) for n in range(8)]
    assert pair.land(keys, received) == [n in (0, 2, 3, 6) for n in range(8)]
    assert stored_payload(pair.reader, KEYS[6]) == block_bytes(pair, 6)
    assert stored_payload(pair.reader, KEYS[1]) is None


def test_a_large_batch_arrives_and_later_batches_reuse_the_connection(pair, make_store):
    keys = pair.put(range(64))
    second_reader = make_store()

    first = pair.fetch(keys)
    second = pair.fetch(keys, reader=second_reader)

    assert pair.land(keys, first) == [True] * 64
    assert pair.land(keys, second, reader=second_reader) == [True] * 64
    assert stored_payload(second_reader, KEYS[63]) == block_bytes(pair, 63)
    # Every engine keeps a TransferStats (kvstore/transfer/base.py).
    assert pair.server.stats.connections_accepted == 1
    assert pair.client.stats.connections_opened == 1


def test_blocks_of_different_payload_sizes_arrive_whole(pair):
    largest = SMALL_PAGE_BYTES - HEADER_BYTES
    sizes = [1, 7, 4096, largest - 1, largest]
    keys = []
    for n, size in enumerate(sizes):
        keys += pair.put([n], size)

    received = pair.fetch(keys)

    assert received == [HEADER_BYTES + size for size in sizes]
    assert pair.land(keys, received) == [True] * len(sizes)
    for n, size in enumerate(sizes):
        assert stored_payload(pair.reader, KEYS[n]) == payload(n, size)


def corrupting(bad_key):
    """Wraps open_block: `bad_key` is served as a copy with one payload byte altered."""

    def wrap(open_block):
        @contextmanager
        def serve(key, tenant):
            with open_block(key, tenant) as view:
                if view is None or key != bad_key:
                    yield view
                    return
                altered = view.clone()
                altered[HEADER_BYTES + 10] ^= 0xFF
                yield altered

        return serve

    return wrap


def test_a_block_altered_at_the_holder_is_delivered_but_never_readable(make_pair):
    pair = make_pair(wrap=corrupting(KEYS[1]))
    keys = pair.put(range(3))

    received = pair.fetch(keys)

    assert received == [SMALL_PAGE_BYTES] * 3  # the transport delivered it...
    assert pair.land(keys, received) == [True, False, True]  # ...the checksum refused it
    assert pair.reader.lookup([KEYS[1]]) == 0
    assert stored_payload(pair.reader, KEYS[1]) is None
    assert pair.reader.checksum_failures == 1


def test_fetching_where_nothing_listens_raises_within_the_timeout(make_transfer_engine, make_store):
    gone = make_transfer_engine()
    address = gone.serve(make_store().open_tenant_block)
    gone.close()
    client, reader = make_transfer_engine(), make_store()

    started = time.monotonic()
    with pytest.raises(TransferError):
        client.fetch(address, TENANT, KEYS[:2], [reader.reserve_page(k) for k in KEYS[:2]], 2.0)
    assert time.monotonic() - started < 3.0


def test_close_is_idempotent_and_a_closed_server_refuses_new_fetches(pair):
    keys = pair.put(range(2))
    assert pair.land(keys, pair.fetch(keys)) == [True, True]

    pair.server.close()
    pair.server.close()

    with pytest.raises(TransferError):
        pair.fetch(KEYS[2:4], timeout_s=2.0)
    pair.client.close()
    pair.client.close()


def test_a_stalled_holder_yields_what_arrived_within_the_timeout(make_pair):
    release = threading.Event()

    def stall_at_block_3(open_block):
        @contextmanager
        def serve(key, tenant):
            if key == KEYS[3]:
                release.wait(10.0)
            with open_block(key, tenant) as view:
                yield view

        return serve

    pair = make_pair(wrap=stall_at_block_3)
    keys = pair.put(range(6))
    try:
        started = time.monotonic()
        received = pair.fetch(keys, timeout_s=0.5)
        elapsed = time.monotonic() - started
    finally:
        release.set()

    assert received == [SMALL_PAGE_BYTES] * 3 + [0] * 3
    assert elapsed < 1.5
    assert pair.land(keys, received) == [True] * 3 + [False] * 3
    assert pair.reader.lookup(keys) == 3


def test_concurrent_fetches_from_several_threads_all_succeed(pair):
    pair.put(range(32))
    batches = [KEYS[start : start + 8] for start in range(0, 32, 8)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(pair.fetch, batches))

    for batch, received in zip(batches, results, strict=True):
        assert pair.land(batch, received) == [True] * 8
    assert all(stored_payload(pair.reader, KEYS[n]) == block_bytes(pair, n) for n in range(32))


def test_an_empty_batch_returns_an_empty_list(pair):
    assert pair.client.fetch(pair.address, TENANT, [], [], 1.0) == []


def test_a_fetch_for_another_tenant_reads_exactly_as_absent(pair):
    keys = pair.put(range(3))  # stored under TENANT

    foreign = pair.fetch(keys + KEYS[3:4], tenant="someone-else")
    pair.land(keys + KEYS[3:4], foreign)
    own = pair.fetch(keys)

    assert foreign == [0, 0, 0, 0]  # present-but-foreign and absent look the same
    assert own == [SMALL_PAGE_BYTES] * 3
    assert pins_drain(pair.holder)


@pytest.mark.parametrize("tenant", ["", "x" * 65, "nul\0inside"], ids=["empty", "long", "nul"])
def test_a_malformed_tenant_is_refused_before_any_io(pair, tenant):
    page = pair.reader.reserve_page(KEYS[0])
    with pytest.raises(ConfigError):
        pair.client.fetch(pair.address, tenant, KEYS[:1], [page], 1.0)
    assert pair.client.stats.connections_opened == 0
