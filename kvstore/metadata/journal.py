"""LMDB persistence of the embedded metadata index: nodes, holdings and counters.

Runs inside the metadata service process; every mutation of the in-memory index is written
through in one LMDB transaction, so a restart finds every published key and registered node.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import lmdb

from kvstore.metadata.index import Holding, NodeRecord

_SEP = b"\x00"
_VALUE = struct.Struct("<QQ")  # size_bytes, checksum
_MAP_SIZE = 8 << 30  # sparse: LMDB only uses what it writes


def _holding_key(tenant: str, key: bytes, node_id: str, tier: str) -> bytes:
    return _SEP.join([key, tenant.encode(), node_id.encode(), tier.encode()])


class JournalWriter:
    """The mutations of one transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, object]) -> None:
        self._txn = txn
        self._dbs = dbs

    def put_node(self, node: NodeRecord) -> None:
        self._txn.put(
            node.node_id.encode(), json.dumps(asdict(node)).encode(), db=self._dbs["nodes"]
        )

    def delete_node(self, node_id: str) -> None:
        self._txn.delete(node_id.encode(), db=self._dbs["nodes"])

    def put_holding(self, tenant: str, key: bytes, holding: Holding) -> None:
        record = _holding_key(tenant, key, holding.node_id, holding.tier)
        value = _VALUE.pack(holding.size_bytes, holding.checksum)
        self._txn.put(record, value, db=self._dbs["holdings"])

    def delete_holding(self, tenant: str, key: bytes, node_id: str, tier: str) -> None:
        self._txn.delete(_holding_key(tenant, key, node_id, tier), db=self._dbs["holdings"])

    def put_counter(self, name: str, value: int) -> None:
        self._txn.put(name.encode(), struct.pack("<Q", value), db=self._dbs["counters"])


class Journal:
    """An LMDB environment under `data_dir` holding the index's durable state."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(data_dir / "metadata.lmdb"), map_size=_MAP_SIZE, max_dbs=4)
        self._dbs = {
            name: self._env.open_db(name.encode()) for name in ("nodes", "holdings", "counters")
        }

    @contextmanager
    def write(self) -> Iterator[JournalWriter]:
        with self._env.begin(write=True) as txn:
            yield JournalWriter(txn, self._dbs)

    def nodes(self) -> list[NodeRecord]:
        with self._env.begin(db=self._dbs["nodes"]) as txn:
            return [NodeRecord(**json.loads(value)) for _, value in txn.cursor()]

    def holdings(self) -> Iterator[tuple[str, bytes, Holding]]:
        """(tenant, key, holding) for every persisted holding."""
        with self._env.begin(db=self._dbs["holdings"]) as txn:
            for record, value in txn.cursor():
                key, tenant, node_id, tier = record[:16], *record[17:].split(_SEP)
                size_bytes, checksum = _VALUE.unpack(value)
                yield (
                    tenant.decode(),
                    key,
                    Holding(node_id.decode(), tier.decode(), size_bytes, checksum),
                )

    def counter(self, name: str) -> int:
        with self._env.begin(db=self._dbs["counters"]) as txn:
            value = txn.get(name.encode())
            return 0 if value is None else struct.unpack("<Q", value)[0]

    def close(self) -> None:
        self._env.close()
