"""Builds and runs the metadata service: gRPC server, health service, lease reaper, metrics.

Runs in the `kvstore metadata` / `kvstore serve` process. The gRPC server is a grpc.aio server
on a loop thread of its own: unary writes run in a pool of `max_workers` threads, in-memory
reads, WatchEvents streams and the lookup port on the loop (a stream holds no thread; Redis
lookups of the port and of LookupStream calls are awaited there). `start()` binds and
returns; `stop()` shuts everything down (SIGTERM handling lives in the CLI).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from kvstore.config import is_loopback_host
from kvstore.errors import ConfigError
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.index.journal import DEFAULT_MAP_SIZE_BYTES, MIN_MAP_SIZE_BYTES
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.server.auth import (
    TokenAuth,
    load_tokens,
    server_credentials,
    server_ssl_context,
)
from kvstore.metadata.server.kube_api import SERVICE_ACCOUNT_DIR, KubeApi, in_cluster_url
from kvstore.metadata.server.kube_tokens import KubeAgentTokens, agent_bindings
from kvstore.metadata.server.lookup_port import LookupPort, listen_address, max_request_bytes
from kvstore.metadata.server.metrics import MetadataMetrics
from kvstore.metadata.server.service import (
    SERVICE_NAME,
    MetadataServicer,
    ServiceLimits,
    rpc_handlers,
)
from kvstore.metadata.server.slots import StreamSlots
from kvstore.metadata.server.watch import EventStreams
from kvstore.settings import setting

logger = logging.getLogger(__name__)

BACKENDS = ("lmdb", "memory", "redis", "redis-cluster")
START_TIMEOUT_S = 30.0
LEASE_THREADS = 4  # heartbeats' own pool (service.py): 3,000/s at 10,000 nodes, each short
MIN_MESSAGE_BYTES = 1 << 20  # a full Publish batch (4096 entries) is ~150 KiB
INDEX_ID_REFRESH_S = 5.0  # how often the lease reaper re-reads the index's id (lookup hellos)


@dataclass(frozen=True)
class MetadataConfig:
    """Settings of one metadata service process; see `kvstore metadata --help`."""

    listen: str = setting(
        "127.0.0.1:50051",
        help="gRPC host:port",
        flag=True,
    )
    backend: str = setting(
        "lmdb",
        help="where the index lives",
        flag=True,
        choices=BACKENDS,
    )
    data_dir: Path = setting(
        Path("./kvstore-data"),
        help="where LMDB keeps the index",
        flag=True,
    )
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        help="redis://host:port/db; redis-cluster: redis://h1:p1,h2:p2",
        flag=True,
    )
    redis_prefix: str = "kvstore"  # the index's keys' prefix; on a cluster, in each hash tag
    redis_wait_replicas: int = setting(
        0,
        help="WAIT for N replicas after each write",
        flag=True,
        ge=0,
    )
    redis_wait_timeout_ms: int = setting(
        100,
        help="WAIT timeout",
        flag=True,
        ge=0,
    )
    redis_failover_timeout_s: float = 10.0  # redis-cluster: retry this long for a new master
    redis_shards: int = setting(
        1,
        help=(
            "shards of the index over a cluster's masters, one hash tag each; 1: one slot "
            "(the single-tag index); 0: 4 per master. Agents do not name their chains' "
            "anchors yet, so a sharded index reads their keys shard by shard; changing it "
            "revokes every lease (agents republish)"
        ),
        flag=True,
        ge=0,
    )
    token_file: Path | None = setting(
        None,
        help="'TOKEN TENANT [node=NODE_ID]' lines; enables auth",
        flag=True,
    )
    # listen beyond loopback without tokens: anyone who reaches the service may read and
    # publish every tenant's keys (warned at every start)
    insecure_no_auth: bool = setting(
        False,
        help=(
            "listen beyond loopback without --token-file: anyone who reaches it may read "
            "and publish every tenant's keys"
        ),
        flag=True,
    )
    # NAMESPACE/NAME: projected tokens (audience kvstore) of this service account act as the
    # node their pod runs on (DaemonSet agents: node id = node name), verified by TokenReview
    kube_agent_service_account: str = setting(
        "",
        help=(
            "accept this service account's projected tokens (audience kvstore), each acting"
            " as the node its pod runs on (TokenReview; enables auth)"
        ),
        flag=True,
        metavar="NAMESPACE/NAME",
    )
    # the same for sidecar agents, whose node id is their pod's name
    kube_sidecar_service_account: str = setting(
        "",
        help="the same for sidecar agents, each acting as its pod's name",
        flag=True,
        metavar="NAMESPACE/NAME",
    )
    kube_api_url: str = ""  # the API server for TokenReviews; empty: in-cluster (the pod's env)
    kube_credentials_dir: Path = SERVICE_ACCOUNT_DIR  # this service's own `token` and `ca.crt`
    tls_cert: Path | None = setting(
        None,
        help="server certificate (PEM)",
        flag=True,
    )
    tls_key: Path | None = setting(
        None,
        help="its private key (PEM)",
        flag=True,
    )
    tls_client_ca: Path | None = setting(
        None,
        help="require client certificates signed by this CA",
        flag=True,
    )
    key_quota_per_tenant: int = setting(
        0,
        help="keys one tenant may hold; 0: unlimited",
        flag=True,
    )
    max_events: int = 100_000
    metrics_listen: str = setting(
        "",
        help="host:port of the Prometheus endpoint; empty: none",
        flag=True,
    )
    max_workers: int = 32  # threads for unary RPCs; streams do not use them
    max_message_bytes: int = 16 << 20  # received and sent; larger is RESOURCE_EXHAUSTED
    max_watch_streams_per_tenant: int = setting(
        16,
        help="WatchEvents streams per tenant",
        flag=True,
    )
    # streams of all-tenant ("*") tokens, which every node agent's view holds one of (and every
    # client when auth is off); they run on the loop, not on threads: the bound is memory
    max_watch_streams_all_tenants: int = setting(
        4096,
        help=("WatchEvents streams of all-tenant tokens: node agents hold one each"),
        flag=True,
    )
    # LookupStream calls (clients keep one open per concurrent lookup, a few each; on the loop)
    max_lookup_streams_per_tenant: int = setting(
        64,
        help=("LookupStream calls per tenant token: a client holds one per concurrent lookup"),
        flag=True,
    )
    max_lookup_streams_all_tenants: int = setting(
        4096,
        help=("LookupStream calls of all-tenant tokens (node agents, routers)"),
        flag=True,
    )
    # the lookup port (lookup_port.py): HOST:PORT, "auto" (gRPC's port + 1) or "off"; its
    # connections hold the LookupStream slots above
    lookup_listen: str = setting(
        "auto",
        help=("the lookup port, HOST:PORT; 'auto': the gRPC port + 1 on its host; 'off'"),
        flag=True,
    )
    lmdb_map_size_bytes: int = setting(
        DEFAULT_MAP_SIZE_BYTES,
        help="LMDB map of the index, e.g. 8GiB",
        flag=True,
    )
    limits: ServiceLimits = field(default_factory=ServiceLimits)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} unknown; use one of {BACKENDS}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both tls_cert and tls_key")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key")
        if self.max_workers < 4:
            raise ConfigError("max_workers must be at least 4 (threads for unary RPCs)")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError(f"max_message_bytes must be at least {MIN_MESSAGE_BYTES}")
        for kind in ("watch", "lookup"):
            caps = (
                getattr(self, f"max_{kind}_streams_{scope}")
                for scope in ("per_tenant", "all_tenants")
            )
            if min(caps) < 1:
                raise ConfigError(
                    f"max_{kind}_streams_per_tenant and _all_tenants must be at least 1"
                )
        if self.redis_shards < 0:
            raise ConfigError("redis_shards must be 0 (fit the servers found) or more")
        if self.redis_failover_timeout_s <= 0:
            raise ConfigError("redis_failover_timeout_s must be positive")
        if self.backend == "redis-cluster" and not self.redis_prefix:
            raise ConfigError(
                "redis_prefix must be non-empty with the redis-cluster backend: it is the hash "
                "tag that keeps the index in one slot ('{}' is none)"
            )
        if self.lmdb_map_size_bytes < MIN_MAP_SIZE_BYTES:
            raise ConfigError(f"lmdb_map_size_bytes must be at least {MIN_MAP_SIZE_BYTES}")
        listen_address(self.lookup_listen, self.listen)  # a ConfigError where malformed
        self.kube_bindings()  # a ConfigError where a service account is malformed
        if not self.auth_configured() and not self.insecure_no_auth and not self.loopback_only():
            raise ConfigError(
                f"the metadata service would listen on {self.listen} (lookup port: "
                f"{self.lookup_listen}) beyond loopback without tokens, so anyone who reaches "
                "it could read and publish every tenant's keys: give --token-file, listen on "
                "127.0.0.1, or --insecure-no-auth to serve it open anyway"
            )

    def auth_configured(self) -> bool:
        """Whether callers must present a token (see auth.py)."""
        return self.token_file is not None or bool(self.kube_bindings())

    def kube_bindings(self) -> dict[str, str]:
        """The agents' service accounts and what names their node (kube_tokens.py)."""
        return agent_bindings(self.kube_agent_service_account, self.kube_sidecar_service_account)

    def kube_api(self) -> KubeApi | None:
        """Where agent tokens are reviewed; None: no Kubernetes agent tokens."""
        if not self.kube_bindings():
            return None
        return KubeApi(self.kube_api_url or in_cluster_url(os.environ), self.kube_credentials_dir)

    def loopback_only(self) -> bool:
        """Whether the gRPC port and the lookup port both listen on loopback only."""
        hosts = [self.listen.rpartition(":")[0].strip("[]")]
        lookup = listen_address(self.lookup_listen, self.listen)
        if lookup is not None:
            hosts.append(lookup[0])
        return all(is_loopback_host(host) for host in hosts)


def open_index(config: MetadataConfig) -> MetadataIndex:
    if config.backend.startswith("redis"):
        from kvstore.metadata.index.redis_cluster import Durability
        from kvstore.metadata.index.redis_shards import open_redis_index

        durability = Durability(config.redis_wait_replicas, config.redis_wait_timeout_ms)
        return open_redis_index(
            config.redis_url,
            shards=config.redis_shards or None,
            prefix=config.redis_prefix,
            key_quota_per_tenant=config.key_quota_per_tenant,
            max_events=config.max_events,
            cluster=config.backend == "redis-cluster",
            durability=durability,
            failover_timeout_s=config.redis_failover_timeout_s,
        )
    data_dir = config.data_dir if config.backend == "lmdb" else None
    return MemoryIndex(
        data_dir,
        config.key_quota_per_tenant,
        config.max_events,
        map_size_bytes=config.lmdb_map_size_bytes,
    )


def _agent_tokens(config: MetadataConfig) -> KubeAgentTokens | None:
    """The reviewer of Kubernetes agent tokens, its credentials checked now (not at the first
    agent's call); None where no agent service account is configured."""
    api = config.kube_api()
    if api is None:
        return None
    api.check()
    return KubeAgentTokens(api, config.kube_bindings())


class MetadataServer:
    def __init__(self, config: MetadataConfig, index: MetadataIndex | None = None) -> None:
        self.config = config
        self.index = index or open_index(config)
        self.metrics = MetadataMetrics()
        self.metrics.watch_index(self.index.stats, lambda: len(self.index.live_nodes()))
        tokens = load_tokens(config.token_file) if config.token_file else {}
        limits = config.limits
        self.streams = EventStreams(
            self.index,
            config.max_watch_streams_per_tenant,
            limits.event_batch,
            limits.watch_poll_s,
            config.max_watch_streams_all_tenants,
        )
        self._pool = futures.ThreadPoolExecutor(config.max_workers, thread_name_prefix="rpc")
        self._lease_pool = futures.ThreadPoolExecutor(LEASE_THREADS, thread_name_prefix="lease")
        lookup_slots = StreamSlots(
            "lookup", config.max_lookup_streams_per_tenant, config.max_lookup_streams_all_tenants
        )
        self.servicer = MetadataServicer(
            self.index,
            TokenAuth(tokens, _agent_tokens(config)),
            self.metrics,
            self.streams,
            self._pool,
            limits,
            lookup_slots,
            self._lease_pool,
        )
        self.lookup_port = LookupPort(
            self.servicer.lookup_access,
            self.metrics.count_calls("LookupPort"),
            min(config.max_message_bytes, max_request_bytes(limits.max_batch)),
        )
        self.health = health.aio.HealthServicer()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self.port = 0
        self.metrics_port = 0

    def start(self) -> int:
        """Bind, serve, start the lease reaper; returns the bound port."""
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="metadata-grpc", daemon=True
        )
        self._loop_thread.start()
        try:
            self.lookup_port.adopt(self.index.index_id())
            self.servicer.loop_lookups = self.index.loop_lookups(self._loop)
            self.port = self._on_loop(self._serve())
        except BaseException:
            self._close_loop()
            raise
        threading.Thread(target=self._reap_leases, name="lease-reaper", daemon=True).start()
        self._start_metrics()
        self._warn_if_open()
        return self.port

    def _warn_if_open(self) -> None:
        if self.servicer.auth.enabled:
            return
        logger.warning(
            "metadata service auth is off (no --token-file): any process that reaches %s, "
            "other local users included, may read and publish every tenant's keys%s",
            self.config.listen,
            "" if self.config.loopback_only() else " (--insecure-no-auth)",
        )

    def _on_loop(self, coroutine, timeout_s: float = START_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    async def _serve(self) -> int:
        options = [
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((rpc_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # the lookup port first: Describe knows it from the first call, and a lookup port that
        # cannot listen stops the start before gRPC binds (a bound, unstarted gRPC server
        # keeps its port until the process ends)
        await self._start_lookup_port()
        try:
            port = self._bind(server)
            await server.start()
        except BaseException:
            await self.lookup_port.stop()
            raise
        self._server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.streams.start(asyncio.get_running_loop())
        self.servicer.start(asyncio.get_running_loop())
        return port

    async def _start_lookup_port(self) -> None:
        """Listen on the lookup port where configured; the servicer's Describe tells clients
        where. Its answers run on the loop, or are awaited there (lookup_port.py)."""
        config = self.config
        address = listen_address(config.lookup_listen, config.listen)
        if address is None:
            return
        if not self.index.nonblocking_reads and self.servicer.loop_lookups is None:
            logger.info(
                "the %s index has no lookups on the loop (a TLS Redis): the lookup port's "
                "answers run in the unary pool",
                self.index.backend,
            )
        tls = None
        if config.tls_cert:
            tls = server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        try:
            port = await self.lookup_port.start(*address, tls)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for lookups on {address[0]}:{address[1]} ({exc}); "
                "set --lookup-listen HOST:PORT or off"
            ) from None
        self.servicer.lookup_port = port
        self.servicer.lookup_instance = self.lookup_port.instance
        logger.info("lookup port listening on %s:%d", address[0], port)

    def _bind(self, server: grpc.aio.Server) -> int:
        config = self.config
        try:
            if config.tls_cert:
                creds = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                port = server.add_secure_port(config.listen, creds)
            else:
                port = server.add_insecure_port(config.listen)
        except RuntimeError:
            port = 0
        if port == 0:
            raise ConfigError(f"cannot listen on {config.listen!r} (in use or not an address)")
        return port

    def _start_metrics(self) -> None:
        if not self.config.metrics_listen:
            return
        host, _, port = self.config.metrics_listen.rpartition(":")
        self._metrics_http, _ = start_http_server(
            int(port), addr=host or "127.0.0.1", registry=self.metrics.registry
        )
        self.metrics_port = self._metrics_http.server_port

    def _reap_leases(self) -> None:
        """Every half of the shortest lease: expire leases; every INDEX_ID_REFRESH_S, follow
        the index's id."""
        period_s = self.config.limits.min_lease_ttl_ms / 1000 / 2
        id_read_at = time.monotonic()
        while not self._stopping.wait(period_s):
            if time.monotonic() - id_read_at >= INDEX_ID_REFRESH_S:
                id_read_at = time.monotonic()
                self._follow_index_id()
            try:
                expired = self.index.expire_leases()
            except Exception:  # the backend may be briefly unreachable; try again next tick
                logger.exception("lease reaper failed")
                continue
            for node_id in expired:
                logger.info("lease of node %s expired; its blocks are unpublished", node_id)
            self.metrics.expired_nodes.inc(len(expired))

    def _follow_index_id(self) -> None:
        """Re-read the index's id (lookup_port.py): a Redis that lost its data has a new one,
        which replicas started since describe; this one takes it too, so they converge."""
        try:
            index_id = self.index.index_id()
        except Exception:  # the backend may be briefly unreachable; try again next time
            logger.exception("reading the index's id failed")
            return
        if index_id != self.lookup_port.instance:
            logger.info("the index has a new id (its state was lost?): lookup hellos follow it")
            self.lookup_port.adopt(index_id)
            if self.servicer.lookup_port:
                self.servicer.lookup_instance = index_id

    def stop(self, grace_s: float = 2.0) -> None:
        self._stopping.set()
        if self._loop is not None and self._server is not None:
            self._on_loop(self._shutdown(grace_s), timeout_s=grace_s + START_TIMEOUT_S)
        self.streams.stop()
        self.servicer.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lease_pool.shutdown(wait=False, cancel_futures=True)
        self.servicer.auth.close()
        self._close_loop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.index.close()

    async def _shutdown(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.lookup_port.stop()
        await self._server.stop(grace_s)
        self._server = None
        if self.servicer.loop_lookups is not None:
            self.servicer.loop_lookups.close()

    def _close_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=START_TIMEOUT_S)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = None
