"""How the Redis index reaches its data: one standalone server, or, in a Redis Cluster, the master
that serves the index's one hash slot (every key is tagged `{prefix}`), followed across failovers.

Runs inside each `kvstore metadata --backend redis` process, under RedisIndex; thread-safe.
`call(fn)` runs fn(client) and maps failures to UnavailableError; the cluster link first retries
with backoff (MOVED, CLUSTERDOWN, connection errors) until its failover budget is spent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from kvstore.errors import ConfigError, UnavailableError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0  # scripts over large batches stay well below this
T = TypeVar("T")
# A master that died, was demoted or lost its slot; MovedError is an AskError.
FAILOVER_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    ReadOnlyError,
    AskError,
    ClusterDownError,
    TryAgainError,
    MasterDownError,
)
UNAVAILABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ReadOnlyError)


@dataclass(frozen=True)
class Durability:
    """`wait_replicas` > 0: every write is followed by `WAIT wait_replicas wait_timeout_ms` on
    its connection, and a write fewer replicas confirm is reported as UnavailableError (it may
    or may not survive a failover; writes are idempotent, so the caller retries)."""

    wait_replicas: int = 0
    wait_timeout_ms: int = 100

    def __post_init__(self) -> None:
        if self.wait_replicas < 0:
            raise ConfigError("redis_wait_replicas must be 0 (no WAIT) or more")
        if self.wait_timeout_ms < 1:
            raise ConfigError("redis_wait_timeout_ms must be at least 1 (0 would block forever)")


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    hosts = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{hosts}"))


def _connection_options() -> dict:
    return {
        "decode_responses": False,
        "protocol": 2,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": COMMAND_TIMEOUT_S,
    }


class StandaloneLink:
    """One Redis server (or a primary with replicas behind one address)."""

    def __init__(self, url: str) -> None:
        self.url = redacted(url)
        try:
            self._redis = redis.Redis.from_url(
                url,
                retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.2), retries=3),
                **_connection_options(),
            )
        except ValueError as exc:
            raise ConfigError(f"redis url {self.url!r} is invalid: {exc}") from exc

    def key_prefix(self, prefix: str) -> bytes:
        return prefix.encode()

    def client(self) -> redis.Redis:
        return self._redis

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        try:
            return fn(self._redis)
        except UNAVAILABLE_ERRORS as exc:
            raise UnavailableError(f"redis at {self.url} is unavailable: {exc}") from exc

    def replication_id(self) -> str:
        """The server's replication id: a new one when a replica is promoted in its place."""
        return _replication_id(self)

    def for_slot_of(self, slot_key: bytes) -> StandaloneLink:
        """One server holds every tag: the same link."""
        return self

    def masters(self) -> int:
        return 1

    def close(self) -> None:
        self._redis.close()


class ClusterLink:
    """The master of one hash slot of a Redis Cluster; `url` is redis://h1:p1,h2:p2,... (seeds:
    any live one will do). Retries for up to `failover_timeout_s` while a replica takes over."""

    def __init__(self, url: str, prefix: str, failover_timeout_s: float = 10.0) -> None:
        self.url = redacted(url)
        self._slot_key = self.key_prefix(prefix) + b":seq"
        self._failover_timeout_s = failover_timeout_s
        self._backoff = ExponentialWithJitterBackoff(base=0.02, cap=0.5)
        self._lock = threading.Lock()
        self._master: redis.Redis | None = None
        seeds = cluster_seeds(url)
        try:
            self._cluster = RedisCluster(
                startup_nodes=seeds,
                password=urlsplit(url).password,
                username=urlsplit(url).username,
                require_full_coverage=False,
                **_connection_options(),
            )
        except redis.RedisError as exc:
            raise UnavailableError(f"redis cluster at {self.url} is unavailable: {exc}") from exc

    @staticmethod
    def key_prefix(prefix: str) -> bytes:
        return b"{" + prefix.encode() + b"}"  # the hash tag: every key of the index, one slot

    def client(self) -> redis.Redis:
        """The master serving the index's slot, as the cluster's slot map last said."""
        with self._lock:
            if self._master is None:
                node = self._cluster.get_node_from_key(self._slot_key)
                self._master = self._cluster.get_redis_connection(node)
            return self._master

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        deadline = time.monotonic() + self._failover_timeout_s
        attempt = 0
        while True:
            try:
                return fn(self.client())
            except FAILOVER_ERRORS as exc:
                if time.monotonic() >= deadline:
                    raise UnavailableError(
                        f"redis cluster at {self.url}: no master for the index's slot after "
                        f"{self._failover_timeout_s} s: {exc}"
                    ) from exc
                logger.debug("redis cluster: %s; refreshing the slot map", exc)
                time.sleep(self._backoff.compute(attempt))
                attempt += 1
                self._refresh()

    def _refresh(self) -> None:
        with self._lock:
            self._master = None
            try:
                self._cluster.nodes_manager.initialize()
            except (redis.RedisError, RedisClusterException, IndexError) as exc:  # mid-failover
                logger.debug("redis cluster: slot map refresh failed: %s", exc)

    def replication_id(self) -> str:
        """The slot master's replication id: a new one when a replica is promoted."""
        return _replication_id(self)

    def for_slot_of(self, slot_key: bytes) -> ClusterLink:
        """A link to the master of `slot_key`'s slot sharing this one's cluster client (its
        slot map and connection pools): one per shard tag of a sharded index."""
        link = object.__new__(ClusterLink)
        link.url, link._slot_key = self.url, slot_key
        link._failover_timeout_s, link._backoff = self._failover_timeout_s, self._backoff
        link._lock, link._master, link._cluster = threading.Lock(), None, self._cluster
        return link

    def masters(self) -> int:
        """How many masters serve slots now (the slot map as last read)."""
        return max(len(self._cluster.get_primaries()), 1)

    def close(self) -> None:
        self._cluster.close()


def _replication_id(link) -> str:
    """The master's replication id; empty where the user may not run INFO (an ACL of
    -@dangerous): a failover is then told only by a lost P:inc (grant +info to the user)."""
    try:
        info = link.call(lambda client: client.info("replication"))
    except redis.ResponseError as exc:  # NoPermissionError among them
        if not _info_refused.is_set():
            _info_refused.set()
            logger.warning(
                "redis refuses INFO (%s): a failover that loses events is not "
                "detected; grant the kvstore user +info",
                exc,
            )
        return ""
    return str(info.get("master_replid", ""))


_info_refused = threading.Event()  # warned once per process


def cluster_seeds(url: str) -> list[ClusterNode]:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"redis cluster url {redacted(url)!r} must start with redis://")
    hosts = parts.netloc.rsplit("@", 1)[-1]
    seeds = []
    for host_port in filter(None, hosts.split(",")):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"redis cluster seed {host_port!r} must be host:port")
        seeds.append(ClusterNode(host, int(port)))
    if not seeds:
        raise ConfigError(f"redis cluster url {redacted(url)!r} names no host:port")
    return seeds
