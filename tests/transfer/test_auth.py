"""Block MACs, narrated: a tag verifies only the frame it was made for (same sequence, block key,
length and bytes, same connection); any other frame, connection or altered byte fails."""

from __future__ import annotations

import os

from kvstore.transfer import auth
from tests.transfer.conftest import KEYS, SECRET


def session() -> auth.Session:
    return auth.Session.derive(SECRET, auth.new_nonce(), auth.new_nonce())


def tag(connection: auth.Session, sequence: int, key: bytes, data: bytes) -> bytes:
    mac = connection.block_mac(sequence, key, len(data))
    for start in range(0, len(data), 1000):  # fed in slices, as the bytes arrive
        mac.update(memoryview(data)[start : start + 1000])
    return mac.finalize()


def test_a_tag_verifies_only_its_own_frame():
    connection, data = session(), os.urandom(4096)
    made = tag(connection, 3, KEYS[0], data)

    assert tag(connection, 3, KEYS[0], data) == made  # the receiver's computation
    assert len(made) == auth.TAG_BYTES
    altered = bytes([data[0] ^ 1]) + data[1:]
    for other in (
        tag(connection, 4, KEYS[0], data),  # a replayed frame at another position
        tag(connection, 3, KEYS[1], data),  # another block's key
        tag(connection, 3, KEYS[0], data[:-1]),  # truncated
        tag(connection, 3, KEYS[0], altered),  # one bit flipped
        tag(session(), 3, KEYS[0], data),  # another connection
    ):
        assert other != made


def test_both_ends_of_a_handshake_derive_the_same_keys_and_no_one_else_does():
    server_nonce = auth.new_nonce()
    hello, client_nonce = auth.client_hello(SECRET, server_nonce)
    proof, server = auth.accept_hello(SECRET, server_nonce, hello)
    client = auth.accept_reply(SECRET, server_nonce, client_nonce, proof)

    assert client == server
    assert client.mac_key != client.key  # the MAC key is its own
    assert auth.accept_hello(b"another-cluster-secret-entirely", server_nonce, hello) is None
