"""Peer authentication and block MACs shared by the transfer engines: a cluster-secret handshake
(both sides prove the secret with HMAC-SHA256 over both nonces and their role) and, per block,
an AES-256-GMAC tag under the connection's MAC key, the frame's sequence number as its nonce
(never reused under a key), over the sequence, length and block key, then the block's bytes.

Runs inside the node agent, on whichever thread or event loop an engine serves or fetches on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvstore.block import MAX_TENANT_BYTES, encode_tenant
from kvstore.config import is_loopback_host
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
HELLO_BYTES = NONCE_BYTES + PROOF_BYTES  # the client's nonce, then its proof
TAG_BYTES = 16  # GMAC
MIN_SECRET_BYTES = 16
_LABEL = b"kvstore-transfer-v1"
_BLOCK = struct.Struct("<QQ")  # sequence number, block length
_NONCE = struct.Struct("<4xQ")  # GCM's 96-bit nonce: the frame's sequence number


def check_secret(secret: bytes | None) -> bytes | None:
    """The cluster secret as given, or ConfigError saying what to change."""
    if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
        raise ConfigError(f"cluster_secret must be bytes of at least {MIN_SECRET_BYTES} bytes")
    return secret


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _prove(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    message = _LABEL + b"/" + role + server_nonce + client_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def client_hello(secret: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """What a client answers the server's nonce with (its nonce + proof), and its nonce."""
    client_nonce = new_nonce()
    return client_nonce + _prove(secret, b"client", server_nonce, client_nonce), client_nonce


def accept_hello(secret: bytes, server_nonce: bytes, hello: bytes) -> tuple[bytes, Session] | None:
    """Server side: the proof to send back and the session, or None if the client failed."""
    client_nonce, proof = hello[:NONCE_BYTES], hello[NONCE_BYTES:]
    if len(hello) != HELLO_BYTES or not hmac.compare_digest(
        proof, _prove(secret, b"client", server_nonce, client_nonce)
    ):
        return None
    session = Session.derive(secret, server_nonce, client_nonce)
    return _prove(secret, b"server", server_nonce, client_nonce), session


def accept_reply(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, proof: bytes
) -> Session | None:
    """Client side: the session, or None if the server failed to prove the secret."""
    if not hmac.compare_digest(proof, _prove(secret, b"server", server_nonce, client_nonce)):
        return None
    return Session.derive(secret, server_nonce, client_nonce)


@dataclass(frozen=True)
class Session:
    """A connection's keys: `key` seals messages, `mac_key` MACs its blocks. Both ends hold
    the same ones; they never travel."""

    key: bytes = field(repr=False)
    mac_key: bytes = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes, server_nonce: bytes, client_nonce: bytes) -> Session:
        key = _prove(secret, b"session", server_nonce, client_nonce)
        return cls(key, hmac.new(key, _LABEL + b"/block-mac", hashlib.sha256).digest())

    def block_mac(self, sequence: int, key: bytes, length: int) -> BlockMac:
        """A MAC for the `sequence`-th frame of the connection (sequences start at 1 and are
        never reused on a connection), for block `key` of `length` bytes: a tag never
        verifies another frame, block or length."""
        return BlockMac(self.mac_key, sequence, _BLOCK.pack(sequence, length) + key)

    def seal(self, label: bytes, data: bytes) -> bytes:
        """A tag over `data` for the message `label` names (e.g. one side's UCX address)."""
        return hmac.new(self.key, _LABEL + b"/" + label + b"/" + data, hashlib.sha256).digest()

    def seal_request(self, number: int, request: bytes) -> bytes:
        """The tag of the connection's `number`-th request (its tenant and keys): a holder
        serves no request an on-path relay rewrote (another tenant's, say) or replayed."""
        return self.seal(b"request-%d" % number, request)


class BlockMac:
    """GMAC (AES-256-GCM over authenticated data only, ~2x Poly1305's speed where the CPU has
    AES and carry-less multiply) fed as the block's bytes pass: update(), then finalize()."""

    def __init__(self, mac_key: bytes, sequence: int, binding: bytes) -> None:
        nonce = modes.GCM(_NONCE.pack(sequence))
        self._gcm = Cipher(algorithms.AES(mac_key), nonce).encryptor()
        self._gcm.authenticate_additional_data(binding)

    def update(self, data) -> None:
        self._gcm.authenticate_additional_data(data)

    def finalize(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag


class Sequenced:
    """What a connection's two ends count in step, for the dataclasses of both engines'
    connections (tcp's Conn, ucx's link), which hold `session`, `frames` and `requests`."""

    session: Session | None
    frames: int
    requests: int

    def next_mac(self, key: bytes, length: int) -> BlockMac | None:
        """The MAC of the next frame, or None on an unauthenticated connection."""
        self.frames += 1
        return None if self.session is None else self.session.block_mac(self.frames, key, length)

    def request_seal(self, request: bytes) -> bytes:
        """The next request's tag (b"" on an unauthenticated connection)."""
        self.requests += 1
        return b"" if self.session is None else self.session.seal_request(self.requests, request)


def tag_matches(mac: BlockMac, tag: bytes | memoryview) -> bool:
    return hmac.compare_digest(mac.finalize(), bytes(tag))


def decode_tenant(raw: bytes) -> str | None:
    """A tenant read off the wire, or None if it is not one `encode_tenant` accepts."""
    if not 0 < len(raw) <= MAX_TENANT_BYTES:
        return None
    try:
        tenant = raw.decode()
        encode_tenant(tenant)
    except (UnicodeDecodeError, ConfigError):
        return None
    return tenant


def warn_if_open(engine: str, host: str, secret: bytes | None) -> None:
    """Log once per serving engine that a non-loopback listener without a secret is open."""
    if secret is not None or is_loopback_host(host):
        return
    logger.warning(
        "%s engine serves %s without a cluster_secret: any host that reaches it can read "
        "every block; set a cluster secret",
        engine,
        host,
    )
