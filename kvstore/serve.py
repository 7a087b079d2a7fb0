"""Process entry points that run services until SIGTERM/SIGINT: `kvstore serve` (the embedded
default: metadata service and one node agent in one process), `kvstore metadata` and
`kvstore node`. Runs in the service process started by the CLI; prints where it listens.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import sys

from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.node.agent import NodeAgent, NodeConfig
from kvstore.stop_signals import StopSignals

logger = logging.getLogger(__name__)
# stuck, not slow: the agent's stop joins a few threads for at most 5 s each
SHUTDOWN_STACKS_AFTER_S = 20.0


def _wait_for_signal() -> None:
    with StopSignals() as signals:
        signals.wait()


def _announce_metrics(what: str, listen: str, port: int) -> None:
    if port:
        host = listen.rpartition(":")[0] or "127.0.0.1"
        print(f"{what} metrics on http://{host}:{port}/metrics", flush=True)


def _announce_metadata(server: MetadataServer) -> None:
    config = server.config
    host = config.listen.rpartition(":")[0]
    where = {"lmdb": f" (data dir {config.data_dir})", "redis": f" ({config.redis_url})"}
    where["redis-cluster"] = where["redis"]
    print(
        f"kvstore metadata service listening on {host}:{server.port}, "
        f"lookup port {server.servicer.lookup_port or 'off'}, "
        f"backend {config.backend}{where.get(config.backend, '')}, "
        f"tls {'on' if config.tls_cert else 'off'}, "
        f"auth {'on' if server.servicer.auth.enabled else 'off'}",
        flush=True,
    )
    _announce_metrics("metadata", config.metrics_listen, server.metrics_port)


def _announce_agent(agent: NodeAgent) -> None:
    config = agent.config
    tiers = ", ".join(
        f"{slot.tier.kind} {slot.tier.capacity_bytes >> 20} MiB" for slot in agent.store.slots
    )
    print(
        f"kvstore node agent {config.node_id} serving workers on {config.socket_path} "
        f"({tiers}); transfer {config.transfer} {agent.transfer_address or '-'}; "
        f"metadata {config.metadata_address or 'none'}",
        flush=True,
    )
    _announce_metrics("agent", config.metrics_listen, agent.metrics_port)


def _run(stoppables: list) -> int:
    try:
        _wait_for_signal()
    finally:
        print("kvstore: shutting down", file=sys.stderr, flush=True)
        _stacks_if_stuck()
        try:
            for service in reversed(stoppables):
                service.stop()
        finally:
            faulthandler.cancel_dump_traceback_later()
    return 0


def _stacks_if_stuck() -> None:
    """A shutdown that hangs says where: every thread's stack on stderr, once."""
    try:
        faulthandler.dump_traceback_later(SHUTDOWN_STACKS_AFTER_S, exit=False)
    except (RuntimeError, ValueError, OSError):  # no stderr file to write to
        logger.debug("no stderr for the shutdown watchdog", exc_info=True)


def run_metadata(config: MetadataConfig) -> int:
    server = MetadataServer(config)
    server.start()
    _announce_metadata(server)
    return _run([server])


def run_node(config: NodeConfig) -> int:
    agent = NodeAgent(config)
    agent.start()
    _announce_agent(agent)
    return _run([agent])


def run_embedded(metadata: MetadataConfig, node: NodeConfig) -> int:
    """The metadata service, then a node agent registered with it, in this one process."""
    server = MetadataServer(metadata)
    server.start()
    _announce_metadata(server)
    host = metadata.listen.rpartition(":")[0]
    agent = NodeAgent(dataclasses.replace(node, metadata_address=f"{host}:{server.port}"))
    try:
        agent.start()
    except BaseException:
        server.stop()
        raise
    _announce_agent(agent)
    return _run([server, agent])
