"""The places a block can be, named once: each tier's name (as records, configs and metrics
spell it), its byte in a worker's lookup answer (agent.proto LookupKeysResponse.tiers), its
value in metadata.proto's Tier enum, and its vLLM KV-event medium (kv_events.py MEDIUM_*).

Pure data, imported by every process: the metadata service, its clients, the node agent, the
client API and the connectors read these instead of keeping tables of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.v1 import metadata_pb2 as pb


@dataclass(frozen=True)
class Tier:
    name: str
    code: bytes  # in a lookup answer; b"" where a worker is never told of it
    proto: int  # metadata.proto Tier; TIER_UNSPECIFIED where the index never holds it
    medium: str | None  # vLLM's KV-event medium; None where vLLM has none


DEVICE = Tier("device", b"", pb.TIER_DEVICE, "GPU")
HOST = Tier("host", b"h", pb.TIER_HOST, "CPU")
DISK = Tier("disk", b"d", pb.TIER_DISK, "STORAGE")
REMOTE = Tier("remote", b"r", pb.TIER_UNSPECIFIED, None)  # another node's, in a lookup answer

STORED = (DEVICE, HOST, DISK)  # the index's tiers, fastest first (the proto's order)
ANSWERS = (HOST, DISK, REMOTE)  # a lookup answer's, nearest first
STORED_NAMES = tuple(tier.name for tier in STORED)
ANSWER_NAMES = tuple(tier.name for tier in ANSWERS)
BY_NAME = {tier.name: tier for tier in (*STORED, REMOTE)}
BY_CODE = {tier.code.decode(): tier for tier in ANSWERS}
BY_PROTO = {tier.proto: tier for tier in STORED}
