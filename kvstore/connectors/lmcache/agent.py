"""The adapter's connection to its host's node agent: one `KVStoreClient`, made again when the
agent comes back after it went away, and at most every `reconnect_interval_s` while it is gone.

Runs in the `lmcache server` process, shared by the adapter's store and read threads (the
client serialises their calls).
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore import errors
from kvstore.client import KVStoreClient
from kvstore.connectors.lmcache.config import KVStoreL2AdapterConfig

logger = logging.getLogger(__name__)
FAILURES = (errors.KVStoreError, OSError)  # what an agent call may raise: each one is a miss


class AgentConnection:
    def __init__(self, config: KVStoreL2AdapterConfig) -> None:
        self.config = config
        self.reconnects = 0
        self._client: KVStoreClient | None = None
        self._lock = threading.Lock()
        self._next_attempt_s = 0.0

    def client(self) -> KVStoreClient | None:
        """The live client, or None while the agent is unreachable. Never raises."""
        with self._lock:
            if self._client is not None and not self._client.broken:
                return self._client
            now = time.monotonic()
            if now < self._next_attempt_s:
                return None
            self._next_attempt_s = now + self.config.reconnect_interval_s
            if self._client is not None:
                _close(self._client)
                self._client, self.reconnects = None, self.reconnects + 1
            self._client = self._connect()
            return self._client

    def _connect(self) -> KVStoreClient | None:
        try:
            return KVStoreClient(
                self.config.socket_path,
                worker="lmcache-l2",
                timeout_s=self.config.timeout_s,
                credential_file=self.config.credential_file or None,
                pin_mapping=False,  # the adapter copies host memory to host memory
                answer_spin_us=self.config.answer_spin_us,
            )
        except FAILURES as exc:
            logger.warning("kvstore agent unavailable at %s: %s", self.config.socket_path, exc)
            return None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                _close(self._client)
            self._client = None


def _close(client: KVStoreClient) -> None:
    try:
        client.close()
    except Exception:  # a broken client may fail to close; it is dropped either way
        logger.debug("closing a kvstore client failed", exc_info=True)
