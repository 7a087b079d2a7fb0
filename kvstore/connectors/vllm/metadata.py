"""What the scheduler half tells the worker half each step: which chunks to load into which
engine blocks, and which to save from which. Built in the scheduler, read in the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.connectors.vllm.compat import KVConnectorMetadata


@dataclass
class LoadSpec:
    req_id: str
    keys: list[bytes]  # chunk keys 0..n-1 of the prompt's loadable prefix
    block_ids: list[list[int]]  # the request's block table per KV cache group
    skip_blocks: int  # leading engine blocks already computed locally: not overwritten
    asynchronous: bool = False  # vLLM's async mode: finished (or failed) per request
    tail_key: bytes = b""  # the prompt's tail after keys (kvstore.keys.tail_key), if loaded
    tail_blocks: int = 0  # engine blocks the tail fills (fewer than a chunk's)

    @property
    def chunks(self) -> int:
        """Stored blocks per head group: the whole chunks, and the tail if any."""
        return len(self.keys) + bool(self.tail_blocks)


@dataclass
class SaveSpec:
    req_id: str
    keys: list[bytes]  # consecutive chunk keys, fully computed by the end of this step
    first_parent: bytes  # key of the chunk before keys[0] (b"" for the first chunk)
    block_ids: list[list[int]]  # per KV cache group: those chunks' blocks, blocks_per_chunk each
    tail_blocks: int = 0  # > 0: keys is the prompt's tail, of this many engine blocks


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests preempted since the last step whose blocks saves still running may read (set
    # only where saves outlive their step): the workers finish their saves before the
    # forward, and forget those requests had saves (no delayed free is owed for them)
    preempted: set[str] = field(default_factory=set)

    @property
    def flush_saves(self) -> bool:
        return bool(self.preempted)
