"""LMDB persistence of the embedded metadata index: nodes, holdings and counters.

Runs inside the metadata service process; every mutation is committed here, in one LMDB
transaction, before the in-memory index applies it, so a restart finds every acknowledged key and
node. A full map or disk is a CapacityError naming the setting to raise, never a silent loss.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import lmdb

from kvstore.errors import CapacityError, KVStoreError
from kvstore.metadata.records import Holding, NodeRecord

_SEP = b"\x00"
_VALUE = struct.Struct("<QQ")  # size_bytes, checksum
DEFAULT_MAP_SIZE_BYTES = 8 << 30  # sparse: LMDB only uses what it writes
MIN_MAP_SIZE_BYTES = 64 << 10
MAP_SIZE_SETTING = "lmdb_map_size_bytes (KVSTORE_METADATA_LMDB_MAP_SIZE_BYTES)"


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

    def __init__(self, data_dir: Path, map_size_bytes: int = DEFAULT_MAP_SIZE_BYTES) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "metadata.lmdb"
        self.map_size_bytes = map_size_bytes
        # writemap=False: with a writable map, a full disk is a SIGBUS that kills the service;
        # without it, LMDB reports ENOSPC as DiskError, which becomes a CapacityError below.
        self._env = lmdb.open(str(self.path), map_size=map_size_bytes, max_dbs=4, writemap=False)
        self._dbs = {
            name: self._env.open_db(name.encode()) for name in ("nodes", "holdings", "counters")
        }

    @contextmanager
    def write(self) -> Iterator[JournalWriter]:
        """One transaction: committed when the block exits, aborted if it raises. CapacityError
        when the map or the disk is full (nothing of the transaction is kept)."""
        try:
            with self._env.begin(write=True) as txn:
                yield JournalWriter(txn, self._dbs)
        except (lmdb.MapFullError, lmdb.TxnFullError) as exc:
            raise CapacityError(
                f"the metadata journal {self.path} is full: its LMDB map size in use is "
                f"{self.map_size_bytes} bytes ({self.map_size_bytes / (1 << 20):.4g} MiB); "
                f"raise {MAP_SIZE_SETTING} and restart ({type(exc).__name__})"
            ) from exc
        except lmdb.DiskError as exc:
            raise CapacityError(
                f"the disk under the metadata journal {self.path} is full: free space there"
            ) from exc
        except lmdb.Error as exc:
            raise KVStoreError(f"the metadata journal {self.path} failed: {exc}") from exc

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
