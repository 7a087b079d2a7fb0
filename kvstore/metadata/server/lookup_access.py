"""What the two long-lived ways of looking up share: LookupStream calls (lookup_stream.py) and
lookup-port connections (lookup_port.py) are authorised by the same tokens, hold slots of one
kind ("lookup") under one cap, get the same answers and end after the same idle time.

Runs in the metadata service process; built once by the servicer (service.py). Answers run on
the loop (`answer`) where the index's reads never block, else are awaited (`answer_later`),
but for those ready without I/O (`answer_now`: the Redis lookups' tracked records).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstore.metadata.server.auth import TenantScope, TokenAuth
from kvstore.metadata.server.slots import StreamSlots
from kvstore.v1 import metadata_pb2 as pb

# answers one serialized LookupRequest for a scope, its failure inside the answer (never raises)
Answer = Callable[[bytes, TenantScope], pb.LookupStreamResponse]
# the same, awaited on the loop (the index's own lookups on it, or its reads in a pool)
LaterAnswer = Callable[[bytes, TenantScope], Awaitable[pb.LookupStreamResponse]]


@dataclass(frozen=True)
class LookupAccess:
    auth: TokenAuth
    slots: StreamSlots  # taken by a call at its start, by a connection at its hello
    answer: Answer
    idle_s: float  # a call or connection with no request for this long is ended
    answer_later: LaterAnswer | None = None  # where set, `answer` would block the loop
    # where answer_later is set: its answer where it is ready without I/O, else None
    answer_now: Callable[[bytes, TenantScope], pb.LookupStreamResponse | None] | None = None

    def answer_ready(self, payload: bytes, scope: TenantScope) -> pb.LookupStreamResponse | None:
        """Where `answer_later` is set: its answer if `answer_now` has it, else None."""
        return None if self.answer_now is None else self.answer_now(payload, scope)
