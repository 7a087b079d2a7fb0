"""Owned keys: how a node's store names a tenant's block, so blocks belong to (tenant, key).

Used by the node agent's store, its worker sessions and its remote fetcher. Keys are derived
from names other tenants may know, so one tenant can compute another's keys: a store keyed by
the key alone would let a block of one tenant answer (or squat) another's save, lookup or
load. An owned key is the 16-byte key followed by the tenant's name (1-64 bytes, no NUL), so
two tenants' blocks of one key are two blocks; the default tenant's is the key alone, which
keeps the disk tier of a single-tenant node readable across this change.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import encode_tenant
from kvstore.keys import KEY_BYTES, BlockKey

DEFAULT_TENANT = "default"


def tenant_tag(tenant: str) -> bytes:
    """What follows the key in `tenant`'s owned keys; ConfigError for a name no block header
    can carry (block.encode_tenant)."""
    return b"" if tenant == DEFAULT_TENANT else encode_tenant(tenant)


def owned_key(tenant: str, key: bytes) -> bytes:
    return bytes(key) + tenant_tag(tenant)


def owned_keys(tenant: str, keys: Sequence[bytes]) -> list[bytes]:
    tag = tenant_tag(tenant)
    return [key + tag for key in keys]


def key_of(owned: bytes) -> BlockKey:
    return BlockKey(owned[:KEY_BYTES])


def tenant_of(owned: bytes) -> str:
    tag = owned[KEY_BYTES:]
    return tag.decode() if tag else DEFAULT_TENANT
