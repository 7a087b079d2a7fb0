"""The blocks a test's node agent holds, read and altered in place: the chain of one prompt,
and a payload overwritten with other KV (resealed with a valid checksum, or not)."""

import dataclasses

import torch

from kvstore import block
from kvstore.owned import owned_key


def stored_chain(agent) -> list[bytes]:
    """The agent's blocks in prefix order (following each header's parent), by owned key."""
    children = {}
    for key, _, tenant in agent.store.inventory():
        with agent.store.open_block(owned_key(tenant, key)) as whole:
            parent = block.unpack_header(whole).parent
        children[None if parent is None else owned_key(tenant, parent)] = owned_key(tenant, key)
    chain, key = [], children.get(None)
    while key is not None:
        chain.append(key)
        key = children.get(key)
    return chain


def alter(agent, key: bytes, reseal: bool) -> None:
    """Overwrite a stored payload in the arena with other floats, with or without a new checksum."""
    host = agent.store.slots[0].tier
    page = host.pages[host.page_index(key)]
    header = block.unpack_header(page)
    payload = page[block.HEADER_BYTES : header.block_bytes]
    generator = torch.Generator().manual_seed(3)
    payload.view(torch.float32).copy_(torch.randn(payload.numel() // 4, generator=generator) * 5)
    if reseal:
        sealed = dataclasses.replace(header, checksum=block.payload_checksum(payload))
        page[: block.HEADER_BYTES].copy_(
            torch.frombuffer(bytearray(block.pack_header(sealed)), dtype=torch.uint8)
        )
