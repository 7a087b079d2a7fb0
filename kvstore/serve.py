"""Process entry points that run services until SIGTERM/SIGINT: `kvstore serve` (the embedded
default) and `kvstore metadata` (the metadata service alone).

Runs in the service process started by the CLI; prints where it listens, stops cleanly.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from kvstore.metadata.server import MetadataConfig, MetadataServer

logger = logging.getLogger(__name__)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()


def _announce(server: MetadataServer) -> None:
    config = server.config
    host = config.listen.rpartition(":")[0]
    where = f" (data dir {config.data_dir})" if config.backend == "lmdb" else ""
    if config.backend == "redis":
        where = f" ({config.redis_url})"
    print(
        f"kvstore metadata service listening on {host}:{server.port}, "
        f"backend {config.backend}{where}, tls {'on' if config.tls_cert else 'off'}, "
        f"auth {'on' if server.servicer.auth.enabled else 'off'}",
        flush=True,
    )
    if server.metrics_port:
        metrics_host = config.metrics_listen.rpartition(":")[0] or "127.0.0.1"
        print(f"metrics on http://{metrics_host}:{server.metrics_port}/metrics", flush=True)


def run_metadata(config: MetadataConfig) -> int:
    """Serve the metadata service until signalled. Returns the process exit code."""
    server = MetadataServer(config)
    server.start()
    _announce(server)
    try:
        _wait_for_signal()
    finally:
        print("kvstore: shutting down", file=sys.stderr, flush=True)
        server.stop()
    return 0
