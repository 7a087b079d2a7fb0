"""The tcp reader's one pass, narrated: each slice is MACed and hashed right after it lands (at
most a slice received at a time, so it is still in cache), the payload's xxh3 reaches
commit_received, which then does not read the page again, and a digest that does not match the
header, or bytes past the block, still make the block a miss."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import xxhash

from kvstore import block
from kvstore.block import HEADER_BYTES, BlockHeader, pack_header
from kvstore.errors import ConfigError
from kvstore.transfer import auth
from kvstore.transfer.tcp import TcpEngine
from kvstore.transfer.tcp_wire import SLICE_BYTES, Landing, recv_exact
from tests.transfer.conftest import KEYS, SECRET, SMALL_PAGE_BYTES, TENANT, Pair, payload


@pytest.fixture(params=[None, SECRET], ids=["open", "secret"])
def tcp_pair(stores, request):
    made = Pair(
        *stores, TcpEngine(cluster_secret=request.param), TcpEngine(cluster_secret=request.param)
    )
    yield made
    made.server.close()
    made.client.close()


def test_the_reader_gets_each_payloads_xxh3_and_commits_without_hashing_again(
    tcp_pair, monkeypatch
):
    keys = tcp_pair.put(range(3))
    pages = [tcp_pair.reader.reserve_page(key) for key in keys]
    checksums = [None] * 3

    received = tcp_pair.client.fetch(tcp_pair.address, TENANT, keys, pages, 5.0, checksums)

    payload_bytes = SMALL_PAGE_BYTES - HEADER_BYTES
    assert checksums == [xxhash.xxh3_64_intdigest(payload(n, payload_bytes)) for n in range(3)]
    monkeypatch.setattr(block, "payload_checksum", pytest.fail)  # the page is not read again
    landed = zip(keys, received, checksums, strict=True)
    assert all(tcp_pair.reader.commit_received(k, n, c) for k, n, c in landed)


def test_an_absent_block_lands_no_checksum(tcp_pair):
    checksums = ["untouched"]
    page = tcp_pair.reader.reserve_page(KEYS[5])

    received = tcp_pair.client.fetch(tcp_pair.address, TENANT, KEYS[5:6], [page], 5.0, checksums)

    assert received == [0] and checksums == [None]


def test_checksums_of_the_wrong_length_are_refused_before_any_io(tcp_pair):
    page = tcp_pair.reader.reserve_page(KEYS[0])
    with pytest.raises(ConfigError, match="1 keys but 2 checksums"):
        tcp_pair.client.fetch(tcp_pair.address, TENANT, KEYS[:1], [page], 5.0, [None, None])
    assert tcp_pair.server.stats.connections_accepted == 0


def landed_block(store, key, size_bytes: int, trailing: bytes = b"") -> tuple[int, int]:
    """Write a well-formed block of `key` (and `trailing` bytes past it) into a reserved page,
    as a holder would send it; returns (bytes received, xxh3 of all of them past the header)."""
    body = payload(7, size_bytes)
    header = BlockHeader(key, None, size_bytes, xxhash.xxh3_64_intdigest(body), tenant=TENANT)
    whole = pack_header(header) + body + trailing
    page = store.reserve_page(key)
    page[: len(whole)].numpy()[:] = memoryview(whole)
    return len(whole), xxhash.xxh3_64_intdigest(whole[HEADER_BYTES:])


def test_a_landed_checksum_that_differs_from_the_header_is_a_miss(stores):
    reader = stores[1]
    size, checksum = landed_block(reader, KEYS[0], 1000)

    assert reader.commit_received(KEYS[0], size, checksum ^ 1) is False
    assert reader.checksum_failures == 1 and reader.lookup(KEYS[:1]) == 0
    assert reader.usage()["host"]["used_pages"] == 0


def test_bytes_past_the_block_are_a_miss_with_a_landed_checksum(stores):
    """The digest covers every byte that landed: it can only vouch for a block that ends
    where the frame does."""
    reader = stores[1]
    size, checksum = landed_block(reader, KEYS[0], 1000, trailing=b"\x01" * 64)

    assert reader.commit_received(KEYS[0], size, checksum) is False
    assert reader.checksum_failures == 1


class RecordingLanding(Landing):
    def __init__(self, mac) -> None:
        super().__init__(mac)
        self.fed: list[tuple[int, int]] = []

    def update(self, frame, start: int, end: int) -> None:
        self.fed.append((start, end))
        super().update(frame, start, end)


@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_a_frame_in_odd_pieces_is_fed_in_order_a_slice_at_most_at_a_time(secret):
    frame = random.Random(3).randbytes(3 * SLICE_BYTES + 77)
    session = auth.Session(b"k" * 32, b"m" * 32) if secret else None
    landing = RecordingLanding(session.block_mac(1, KEYS[0], len(frame)) if session else None)
    into = bytearray(len(frame))
    ours, theirs = socket.socketpair()

    def dribble() -> None:
        rng, sent = random.Random(4), 0
        while sent < len(frame):
            piece = frame[sent : sent + rng.choice([1, 999, 70_000, SLICE_BYTES + 5])]
            theirs.sendall(piece)
            sent += len(piece)

    sender = threading.Thread(target=dribble)
    with ours, theirs:
        sender.start()
        recv_exact(ours, memoryview(into), time.monotonic() + 30, landing)
        sender.join()

    assert bytes(into) == frame
    assert [end - start for start, end in landing.fed][:3] == [SLICE_BYTES] * 3
    assert [start for start, _ in landing.fed] == [end for _, end in [(0, 0), *landing.fed[:-1]]]
    assert landing.fed[-1][1] == len(frame)
    assert landing.payload_checksum(len(frame)) == xxhash.xxh3_64_intdigest(frame[HEADER_BYTES:])
    if session:
        whole = session.block_mac(1, KEYS[0], len(frame))
        whole.update(frame)
        assert auth.tag_matches(landing.mac, whole.finalize())


def test_a_frame_shorter_than_a_header_lands_no_checksum():
    landing = Landing(None)
    landing.update(memoryview(b"x" * 100), 0, 100)
    assert landing.payload_checksum(100) is None
