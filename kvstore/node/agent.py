"""The node agent: composes the host arena and disk tier (a TieredStore), the transfer engine,
the metadata link and the control server for local workers. Runs as `kvstore node`, or inside
`kvstore serve` beside the metadata service.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import start_http_server

from kvstore.block import HEADER_BYTES
from kvstore.config import read_secret_file
from kvstore.errors import ConfigError
from kvstore.eviction import make_policy
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.client.token_file import TokenFile
from kvstore.metadata.records import NodeRecord
from kvstore.node.control import ControlLimits, ControlServer
from kvstore.node.demotion import DemotionThread, free_pages_target
from kvstore.node.identity import WorkerCredentials, WorkerIdentity
from kvstore.node.link import MetadataLink
from kvstore.node.metrics import agent_registry
from kvstore.node.private import PrivateBuffer
from kvstore.node.remote import RemoteFetcher
from kvstore.node.session import RequestCounters, WorkerSession
from kvstore.node.view import ClusterView
from kvstore.node.view_feed import ViewFeed
from kvstore.settings import setting
from kvstore.store import ArenaLimits, TieredStore, TierSlot
from kvstore.tiers.base import check_max_block
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier, remove_stale_arenas
from kvstore.tiers.throttled import ThrottledDiskTier
from kvstore.transfer.base import make_engine

logger = logging.getLogger(__name__)
DEFAULT_PAGE_BYTES = (32 << 20) + HEADER_BYTES  # a 256-token chunk of Llama-3-8B in bf16
DEFAULT_SOCKET_PATH = Path("/run/kvstore/agent.sock")


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one node agent; see `kvstore node --help`."""

    node_id: str = setting(
        default_factory=socket.gethostname,
        help="this host's name in the cluster (default: hostname)",
        flag=True,
    )
    socket_path: Path = setting(
        DEFAULT_SOCKET_PATH, help="unix socket workers connect to", flag=True
    )
    host_capacity_bytes: int = setting(
        4 << 30, help="shared-memory arena size, e.g. 8GiB", flag=True
    )
    page_size_bytes: int = setting(
        DEFAULT_PAGE_BYTES,
        help="the arenas' allocation unit: a block takes the fewest whole pages that hold it "
        "(header included), contiguous; with the default --max-block-bytes, one page is the "
        "largest block",
        flag=True,
    )
    max_block_bytes: int = setting(
        0,
        help="largest block, header included (0: one page); above a page, blocks of every "
        "model and TP size share the arena, each wasting less than a page, e.g. 64MiB with "
        "--page-size-bytes 256KiB",
        flag=True,
    )
    disk_dir: Path | None = setting(None, help="LMDB disk tier directory (none: off)", flag=True)
    disk_capacity_bytes: int = setting(64 << 30, help="disk tier size, e.g. 200GiB", flag=True)
    host_policy: str = setting("prefix-lru", help="eviction policy of the host tier", flag=True)
    disk_policy: str = setting("prefix-lru", help="eviction policy of the disk tier", flag=True)
    disk_read_bytes_per_s: int = 0  # > 0: hold disk reads to this rate (tests: a slow disk)
    disk_write_bytes_per_s: int = 0  # > 0: hold disk writes to this rate (tests: a slow disk)
    # arena pages kept free by writing victims to disk ahead of need; -1: 1/32 of the arena
    host_free_pages: int = -1
    # empty: this node serves only its own blocks
    metadata_address: str = setting("", help="host:port of the metadata service", flag=True)
    metadata_token_file: Path | None = setting(
        None, help="file holding a `*` metadata token", flag=True
    )
    metadata_tls_ca: Path | None = None
    worker_credentials: Path | None = setting(
        None,
        help="lines 'token:T|uid:N|gid:N TENANTS' (default: this user, every tenant)",
        flag=True,
    )
    cluster_secret_file: Path | None = setting(
        None, help="secret every agent shares; authenticates transfers", flag=True
    )
    insecure_transfer: bool = setting(
        False,
        help="serve transfers without --cluster-secret-file: any process that reaches the "
        "port, other local users included, may read every block",
        flag=True,
    )
    max_workers: int = setting(256, help="worker connections at once", flag=True)
    max_pins_per_worker: int = setting(65536, help="pages one worker may hold", flag=True)
    # a tenant's reservations and pins hold at most this share of the arena's pages while
    # other tenants use it (1.0: no bound)
    tenant_share: float = setting(
        0.5,
        help="share of the arena one tenant's reserved and pinned pages may hold while other "
        "tenants use it",
        flag=True,
    )
    reservation_ttl_s: float = setting(
        120.0, help="a save not committed by then is released", flag=True
    )
    # arena pages no save may reserve, so a block on disk can always be promoted to be read;
    # -1: 1/64 of the arena with a disk tier (none without one, or under 64 pages)
    promotion_reserve_pages: int = setting(
        -1,
        help="arena pages no save may reserve, kept for promotions from disk (-1: 1/64 with a "
        "disk tier)",
        flag=True,
    )
    orphan_pin_ttl_s: float = 600.0
    control_frame_timeout_s: float = 10.0
    private_buffer_bytes: int = setting(256 << 20, help="buffer of each private worker", flag=True)
    transfer: str = setting(
        "tcp", help="transfer engine", flag=True, choices=("tcp", "ucx", "none")
    )
    transfer_host: str = setting("127.0.0.1", help="address the transfer engine binds", flag=True)
    transfer_port: int = setting(0, help="its port; 0: any free one", flag=True)
    advertise_host: str = setting(
        "", help="address other nodes dial (default: the bind address)", flag=True
    )
    lease_ttl_ms: int = 10_000
    fetch_timeout_s: float = 5.0
    metrics_listen: str = setting(
        "", help="host:port of the agent's metrics", flag="--node-metrics-listen"
    )
    view_max_keys: int = setting(
        1_000_000, help="keys the cluster view holds (0: ask the service)", flag=True
    )
    view_resync_min_interval_s: float = 30.0  # after an overflow, a snapshot at most this often

    def __post_init__(self) -> None:
        if self.transfer not in ("tcp", "ucx", "none"):
            raise ConfigError(f"transfer {self.transfer!r} unknown; use tcp, ucx or none")
        if self.view_max_keys < 0 or self.view_resync_min_interval_s < 0:
            raise ConfigError("view_max_keys and view_resync_min_interval_s must be >= 0")
        if self.disk_read_bytes_per_s < 0 or self.disk_write_bytes_per_s < 0:
            raise ConfigError(
                "disk_read_bytes_per_s and disk_write_bytes_per_s must be >= 0 (0: full speed)"
            )
        if self.host_free_pages < -1:
            raise ConfigError("host_free_pages must be >= 0, or -1 (1/32 of the arena)")
        if not 0 < self.tenant_share <= 1:
            raise ConfigError(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if self.reservation_ttl_s <= 0 or self.promotion_reserve_pages < -1:
            raise ConfigError("reservation_ttl_s must be > 0 and promotion_reserve_pages >= -1")
        if self.page_size_bytes <= HEADER_BYTES:
            raise ConfigError(f"page_size_bytes must exceed the {HEADER_BYTES}-byte header")
        check_max_block(self.max_block_bytes, self.page_size_bytes, self.host_capacity_bytes)
        self._require_transfer_secret()
        if self.transfer == "none" and self.metadata_address:
            logger.warning("no transfer engine: blocks of other nodes cannot be fetched")
        self.control_limits()  # validates the bounds now, not at start

    def _require_transfer_secret(self) -> None:
        """A transfer engine without a cluster secret serves every block to any process that
        reaches its port, the loopback one included: every local user."""
        if self.transfer == "none" or self.cluster_secret_file:
            return
        if self.worker_credentials:
            raise ConfigError(
                "worker credentials keep tenants apart, but without a cluster secret the "
                f"{self.transfer} transfer engine serves any tenant's blocks to any process "
                "that reaches its port (the loopback one too): give --cluster-secret-file, or "
                "--transfer none on a single node"
            )
        if not self.insecure_transfer:
            raise ConfigError(
                f"without a cluster secret the {self.transfer} transfer engine serves every "
                "block to any process that reaches its port (the loopback one too: every local "
                "user): give --cluster-secret-file (the same secret on every agent), "
                "--transfer none on a single node, or --insecure-transfer to serve them anyway"
            )

    def control_limits(self) -> ControlLimits:
        return ControlLimits(
            max_workers=self.max_workers,
            max_pins_per_worker=self.max_pins_per_worker,
            orphan_pin_ttl_s=self.orphan_pin_ttl_s,
            frame_timeout_s=self.control_frame_timeout_s,
        )

    @property
    def largest_block_bytes(self) -> int:
        """The largest block, header included: max_block_bytes, or one page."""
        return self.max_block_bytes or self.page_size_bytes

    def arena_limits(self) -> ArenaLimits:
        """How tenants share the arena (see ArenaLimits); -1 promotion pages: 1/64 of it when
        there is a disk tier to promote from, else none."""
        pages = self.host_capacity_bytes // self.page_size_bytes
        reserve = self.promotion_reserve_pages
        if reserve < 0:
            reserve = pages // 64 if self.disk_dir is not None else 0
        return ArenaLimits(
            tenant_share=self.tenant_share,
            promotion_reserve_pages=reserve,
            reservation_ttl_s=self.reservation_ttl_s,
        )

    def worker_table(self) -> WorkerCredentials:
        if self.worker_credentials is None:
            return WorkerCredentials.owner_only()
        return WorkerCredentials.from_file(self.worker_credentials)

    def cluster_secret(self) -> bytes | None:
        if self.cluster_secret_file is None:
            return None
        return read_secret_file(self.cluster_secret_file, "cluster secret").encode()


class NodeAgent:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.counters = RequestCounters()
        self.store: TieredStore | None = None
        self.engine = None
        self.link: MetadataLink | None = None
        self.fetcher: RemoteFetcher | None = None
        self.view: ClusterView | None = None
        self.view_feed: ViewFeed | None = None
        self.demotion: DemotionThread | None = None
        self.control: ControlServer | None = None
        self.transfer_address = ""
        self.metrics_port = 0
        self._metrics_http = None

    def start(self) -> None:
        config = self.config
        for name in remove_stale_arenas():
            logger.info("removed shared arena %s left by a dead agent", name)
        self.store = TieredStore(self._slots(), limits=config.arena_limits())
        self._start_demotion()
        if config.transfer != "none":
            secret = config.cluster_secret()
            self.engine = make_engine(
                config.transfer, **({"cluster_secret": secret} if secret else {})
            )
            self.transfer_address = self.engine.serve(
                self.store.open_tenant_block, config.transfer_host, config.transfer_port
            )
            if secret is None:
                logger.warning(
                    "insecure transfer: the %s transfer engine on %s serves every block to any "
                    "process that reaches it, other local users included (no cluster secret)",
                    config.transfer,
                    self.transfer_address,
                )
        if config.metadata_address:
            self._start_link()
        self.control = ControlServer(
            config.socket_path,
            self._new_session,
            self._hello(),
            self.store.slots[0].tier.arena.open_fd,
            self.stats_json,
            config.fetch_timeout_s,
            config.worker_table(),
            config.control_limits(),
        )
        self.control.start()
        self._start_metrics()

    def _start_demotion(self) -> None:
        host = self.store.slots[0].tier
        free_pages = free_pages_target(self.config.host_free_pages, host.capacity_pages)
        if len(self.store.slots) > 1 and free_pages > 0:
            self.demotion = DemotionThread(self.store, free_pages)
            self.demotion.start()

    def _slots(self) -> list[TierSlot]:
        config = self.config
        largest = config.max_block_bytes
        host = HostTier(config.host_capacity_bytes, config.page_size_bytes, max_block_bytes=largest)
        slots = [TierSlot(host, make_policy(config.host_policy))]
        if config.disk_dir is not None:
            sizes = (config.disk_dir, config.disk_capacity_bytes, config.page_size_bytes)
            rates = {
                "read_bytes_per_s": config.disk_read_bytes_per_s,
                "write_bytes_per_s": config.disk_write_bytes_per_s,
            }
            if any(rates.values()):
                disk = ThrottledDiskTier(*sizes, max_block_bytes=largest, **rates)
            else:
                disk = DiskTier(*sizes, max_block_bytes=largest)
            slots.append(TierSlot(disk, make_policy(config.disk_policy)))
        return slots

    def _advertised(self, address: str) -> str:
        """The address peers dial: advertise_host, or the bind address unless it is a wildcard
        (then this host's primary address)."""
        host, _, port = address.rpartition(":")
        if not address:
            return address
        if self.config.advertise_host:
            host = self.config.advertise_host
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"

    def _start_link(self) -> None:
        config = self.config
        address = self._advertised(self.transfer_address)
        node = NodeRecord(
            config.node_id,
            tcp_address=address if config.transfer == "tcp" else "",
            ucx_address=address if config.transfer == "ucx" else "",
            tier_capacity_bytes={
                slot.tier.kind: slot.tier.capacity_bytes for slot in self.store.slots
            },
        )
        self.link = MetadataLink(self._metadata_client(), node, self.store, config.lease_ttl_ms)
        self.link.start()
        if self.engine is not None:
            self._start_view()
            self.fetcher = RemoteFetcher(
                self.store, self.link, self.engine, config.node_id, self.view
            )

    def _metadata_client(self) -> MetadataClient:
        """Its token is read again as the file is replaced (a projected service-account token
        is, while the agent runs: deploy/README.md)."""
        config = self.config
        path = config.metadata_token_file
        token = TokenFile.read(path) if path is not None else None
        return MetadataClient(config.metadata_address, token=token, tls_ca=config.metadata_tls_ca)

    def _start_view(self) -> None:
        """The cluster view of this agent's tenants, on its own channel (a long stream and a
        snapshot must not queue behind the link's publishes)."""
        config = self.config
        if not config.view_max_keys:
            return
        tenants = config.worker_table().tenants()
        self.view = ClusterView(config.node_id, tenants, config.view_max_keys)
        self.view_feed = ViewFeed(
            self._metadata_client(), self.view, config.view_resync_min_interval_s
        )
        self.view_feed.start()

    def _hello(self):
        from kvstore.v1 import agent_pb2 as pb

        host = self.store.slots[0].tier
        return pb.HelloResponse(
            node_id=self.config.node_id,
            arena_name=host.arena_name,
            num_pages=host.capacity_pages,
            page_size_bytes=host.page_size_bytes,
            header_bytes=HEADER_BYTES,
        )

    def _new_session(self, identity: WorkerIdentity) -> WorkerSession:
        private = None
        if not identity.shared_arena:
            private = PrivateBuffer(
                f"kvstore-worker-{identity.peer.pid}",
                self.config.private_buffer_bytes,
                self.config.largest_block_bytes - HEADER_BYTES,
            )
        return WorkerSession(
            self.store,
            self.fetcher,
            self.counters,
            identity,
            self.config.max_pins_per_worker,
            private,
        )

    def _start_metrics(self) -> None:
        if not self.config.metrics_listen:
            return
        host, _, port = self.config.metrics_listen.rpartition(":")
        registry = agent_registry(self.stats)
        self._metrics_http, _ = start_http_server(
            int(port), addr=host or "127.0.0.1", registry=registry
        )
        self.metrics_port = self._metrics_http.server_port

    def stats(self) -> dict:
        fetch = self.fetcher.stats if self.fetcher else None
        return {
            "node_id": self.config.node_id,
            "tiers": self.store.usage(),
            "requests": self.counters.snapshot(),
            "transfer": {
                "engine": self.config.transfer,
                "address": self.transfer_address,
                "blocks": fetch.blocks if fetch else 0,
                "bytes": fetch.bytes if fetch else 0,
                "seconds": fetch.seconds if fetch else 0.0,
                "failures": fetch.failures if fetch else 0,
                "failed_fetches": fetch.failed_fetches if fetch else 0,
                "engine_events": dataclasses.asdict(self.engine.stats) if self.engine else {},
            },
            "checksum_failures": self.store.checksum_failures,
            "demotion_write_failures": self.store.write_failures,
            "evictions": dict(self.store.removals),
            "demoted_ahead": self.demotion.written if self.demotion else 0,
            "pins": self.store.pins_held(),
            "workers": len(self.control.sessions) if self.control else 0,
            "orphaned_workers": len(self.control.orphans) if self.control else 0,
            "orphaned_pages": self.control.orphans.pages_held() if self.control else 0,
            "refused": dict(self.control.refused) if self.control else {},
            "metadata_connected": bool(self.link and self.link.connected),
            "published_blocks": self.link.published if self.link else 0,
            "dropped_blocks": self.link.dropped_blocks if self.link else 0,
            "dropped_by_cause": dict(self.link.dropped_by_cause) if self.link else {},
            "view": self._view_stats(),
            "tenants": {
                "pages": self.store.tenant_pages(),
                "share_refusals": self.store.share_refusals,
                "expired_reservations": self.store.expired_reservations,
            },
        }

    def _view_stats(self) -> dict:
        if self.view is None:
            return {}
        return {**self.view.stats(), "seq": self.view_feed.seq, "disabled": self.view_feed.disabled}

    def stats_json(self) -> str:
        return json.dumps(self.stats())

    def stop(self) -> None:
        if self.control is not None:
            self.control.stop()
        if self.view_feed is not None:
            self.view_feed.stop()
        if self.link is not None:
            self.link.stop()
        if self.engine is not None:
            self.engine.close()
        writing = self.demotion is not None and not self.demotion.stop()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        if self.store is not None and not writing:  # never close a tier a thread writes into
            self.store.close()
