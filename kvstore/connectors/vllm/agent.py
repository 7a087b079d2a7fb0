"""A connector half's connection to its host's node agent: opened on demand, dropped when it
breaks, so an absent or restarted agent costs recomputes, never a failed request; and one
such connection per thread, for the scheduler's staging threads. Runs in the vLLM scheduler and
worker processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm.config import ConnectorSettings
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AgentConnection:
    def __init__(self, settings: ConnectorSettings, worker: str, pin_mapping: bool = True) -> None:
        self.settings = settings
        self.worker = worker
        self.pin_mapping = pin_mapping  # off where payloads are never copied (the scheduler)
        self._client: KVStoreClient | None = None

    @property
    def client(self) -> KVStoreClient | None:
        """The client, (re)connected if needed; None while no agent answers."""
        if self._client is None:
            try:
                self._client = KVStoreClient(
                    self.settings.socket_path,
                    self.worker,
                    pin_mapping=self.pin_mapping,
                    credential_file=self.settings.credential_file or None,
                    answer_spin_us=self.settings.answer_spin_us,
                )
            except KVStoreError as exc:
                logger.warning("kvstore agent unavailable (%s); prefixes are computed", exc)
        return self._client

    def call(self, use: Callable[[KVStoreClient], T], otherwise: T) -> T:
        """`use(client)`, or `otherwise` while no agent answers; a KVStoreError drops the
        connection (the next call reconnects) and is raised."""
        client = self.client
        if client is None:
            return otherwise
        try:
            return use(client)
        except KVStoreError:
            self.drop()
            raise

    @property
    def node_id(self) -> str | None:
        """The agent's node id once connected (this never connects)."""
        return self._client.info.node_id if self._client is not None else None

    def drop_if_broken(self) -> None:
        if self._client is not None and self._client.broken:
            self.drop()

    def drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # the agent may be gone; nothing to release there
                logger.debug("closing a dead kvstore client", exc_info=True)


class ThreadConnections:
    """One AgentConnection per thread that asks for one (each staging thread's own: a
    connection answers one call at a time), all dropped together at shutdown."""

    def __init__(self, make: Callable[[], AgentConnection]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._made: list[AgentConnection] = []

    @property
    def connection(self) -> AgentConnection:
        """The calling thread's connection, made on its first call."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._make()
            with self._lock:
                self._made.append(connection)
        return connection

    def drop(self) -> None:
        with self._lock:
            for connection in self._made:
                connection.drop()
