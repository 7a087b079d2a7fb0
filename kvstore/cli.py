"""The `kvstore` command line: one subcommand per entry point (serve, node, metadata, stats,
events, replay, plan; the `bench` ones are in kvstore/bench/commands.py).

Runs in the user's shell process; every subcommand validates its arguments here, once, and
prints either a readable summary or, with --json, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstore.errors import AuthError, KVStoreError


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(name) for name in result)
    for name, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{name:<{width}}  {shown}")


def _replay(args: argparse.Namespace) -> dict:
    from kvstore.replay import run_replay

    return run_replay(args.trace, args.policy, args.capacity_blocks, progress=sys.stderr.isatty())


def _plan(args: argparse.Namespace) -> dict | int:
    from kvstore.plan.command import run_plan_command

    return run_plan_command(args)


def _metadata_config(args: argparse.Namespace, **overrides):
    from kvstore.config import build_config, read_toml_section
    from kvstore.metadata.server.server import MetadataConfig

    flags = {name: getattr(args, name, None) for name in _METADATA_FLAGS}
    flags.update(overrides)
    section = read_toml_section(args.config, "metadata")
    return build_config(MetadataConfig, section, os.environ, flags, "KVSTORE_METADATA_")


_METADATA_FLAGS = (
    "listen",
    "backend",
    "data_dir",
    "redis_url",
    "token_file",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "key_quota_per_tenant",
    "metrics_listen",
    "max_watch_streams_per_tenant",
    "lmdb_map_size_bytes",
    "redis_wait_replicas",
    "redis_wait_timeout_ms",
    "max_watch_streams_all_tenants",
    "max_lookup_streams_per_tenant",
    "max_lookup_streams_all_tenants",
    "lookup_listen",
    "insecure_no_auth",
    "kube_agent_service_account",
    "kube_sidecar_service_account",
)


_NODE_FLAGS = (
    "node_id",
    "socket_path",
    "host_capacity_bytes",
    "page_size_bytes",
    "disk_dir",
    "disk_capacity_bytes",
    "host_policy",
    "disk_policy",
    "metadata_address",
    "metadata_token_file",
    "worker_credentials",
    "cluster_secret_file",
    "max_workers",
    "max_pins_per_worker",
    "private_buffer_bytes",
    "transfer",
    "transfer_host",
    "transfer_port",
    "advertise_host",
    "node_metrics_listen",
    "view_max_keys",
    "insecure_transfer",
    "tenant_share",
    "reservation_ttl_s",
    "promotion_reserve_pages",
)


def _node_config(args: argparse.Namespace, **overrides):
    from kvstore.config import build_config, read_toml_section
    from kvstore.node.agent import NodeConfig

    flags = {name: getattr(args, name, None) for name in _NODE_FLAGS}
    flags["metrics_listen"] = flags.pop("node_metrics_listen")
    for name, value in overrides.items():
        if flags.get(name) is None:
            flags[name] = value
    section = read_toml_section(args.config, "node")
    return build_config(NodeConfig, section, os.environ, flags, "KVSTORE_NODE_")


def _serve(args: argparse.Namespace) -> int:
    """The embedded default, closed to other local users: its transfer engine and metadata
    service take only the secrets it keeps in its data dir (serve_secrets.py)."""
    from kvstore.serve import run_embedded
    from kvstore.serve_secrets import ServeSecrets

    # never open: the service takes the tokens made below, whatever --listen says
    given = _metadata_config(args, backend="lmdb", insecure_no_auth=True)
    own = ServeSecrets(given.data_dir)
    defaults = {
        "disk_dir": given.data_dir / "disk",
        "socket_path": given.data_dir / "agent.sock",
        "host_capacity_bytes": 1 << 30,
        "cluster_secret_file": own.cluster_secret_file,
        "metadata_token_file": own.agent_token_file,
    }
    node = _node_config(args, **defaults)
    if args.check:
        from kvstore.checks import check_embedded

        return check_embedded(given, node, own)
    own.ensure(node.node_id, given.token_file)
    metadata = dataclasses.replace(given, token_file=own.tokens_file, insecure_no_auth=False)
    return run_embedded(metadata, node)


def _node(args: argparse.Namespace) -> int:
    from kvstore.serve import run_node

    if args.check:
        from kvstore.checks import check_node

        return check_node(_node_config(args))
    return run_node(_node_config(args))


def _metadata(args: argparse.Namespace) -> int:
    from kvstore.serve import run_metadata

    if args.check:
        from kvstore.checks import check_metadata

        return check_metadata(_metadata_config(args))
    return run_metadata(_metadata_config(args))


def _metadata_token(args: argparse.Namespace) -> str | None:
    """The token of --token-file, or the operator token of a `kvstore serve` --data-dir."""
    from kvstore.config import read_secret_file
    from kvstore.serve_secrets import ServeSecrets

    if args.token_file:
        return read_secret_file(args.token_file, "metadata token")
    if args.data_dir:
        return ServeSecrets(args.data_dir).operator_token()
    return None


def _stats(args: argparse.Namespace) -> dict | int:
    from kvstore.metadata.client import MetadataClient
    from kvstore.stats import format_stats, stats_dict

    try:
        with MetadataClient(args.address, token=_metadata_token(args), tls_ca=args.tls_ca) as meta:
            stats = stats_dict(meta.stats())
    except AuthError as exc:
        hint = "give --token-file, or the --data-dir of the `kvstore serve` asked"
        raise AuthError(f"{exc}; {hint}") from None
    if args.json:
        return stats
    print(format_stats(stats))
    return 0


def _events(args: argparse.Namespace) -> dict:
    from kvstore.events_zmq import EventsConfig, run_events
    from kvstore.stop_signals import StopSignals

    token = _metadata_token(args)
    config = EventsConfig(
        metadata_address=args.metadata_address,
        zmq_endpoint=args.zmq,
        model=args.model,
        replay_endpoint=args.replay,
        tenant=args.tenant,
        token=token,
        tls_ca=args.tls_ca,
        block_tokens=args.block_tokens,
        int_hashes=not args.bytes_hashes,
    )
    with StopSignals() as stop:
        return run_events(config, stop)


def _add_metadata_flags(parser: argparse.ArgumentParser, with_backend: bool) -> None:
    parser.add_argument("--config", type=Path, help="TOML file; settings under [metadata]")
    parser.add_argument("--listen", help="gRPC host:port (default 127.0.0.1:50051)")
    if with_backend:
        parser.add_argument("--backend", choices=["lmdb", "memory", "redis", "redis-cluster"])
        parser.add_argument(
            "--insecure-no-auth",
            action="store_true",
            default=None,
            help="listen beyond loopback without --token-file: anyone who reaches it may read "
            "and publish every tenant's keys",
        )
        parser.add_argument(
            "--redis-url", help="redis://host:port/db; redis-cluster: redis://h1:p1,h2:p2 (seeds)"
        )
        parser.add_argument(
            "--redis-wait-replicas", type=int, help="WAIT for N replicas after each write (0)"
        )
        parser.add_argument("--redis-wait-timeout-ms", type=int, help="WAIT timeout (100)")
    parser.add_argument("--data-dir", type=Path, help="where LMDB keeps the index")
    parser.add_argument(
        "--token-file", type=Path, help="'TOKEN TENANT [node=NODE_ID]' lines; enables auth"
    )
    parser.add_argument(
        "--kube-agent-service-account",
        metavar="NAMESPACE/NAME",
        help="accept this service account's projected tokens (audience kvstore), each acting as "
        "the node its pod runs on (TokenReview; enables auth)",
    )
    parser.add_argument(
        "--kube-sidecar-service-account",
        metavar="NAMESPACE/NAME",
        help="the same for sidecar agents, each acting as its pod's name",
    )
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--tls-client-ca", type=Path, help="require client certificates")
    parser.add_argument("--key-quota-per-tenant", type=int)
    parser.add_argument(
        "--max-watch-streams-per-tenant", type=int, help="WatchEvents streams per tenant (16)"
    )
    parser.add_argument(
        "--max-watch-streams-all-tenants",
        type=int,
        help="WatchEvents streams of all-tenant tokens: node agents hold one each (4096)",
    )
    parser.add_argument(
        "--max-lookup-streams-per-tenant",
        type=int,
        help="LookupStream calls per tenant token: a client holds one per concurrent lookup (64)",
    )
    parser.add_argument(
        "--max-lookup-streams-all-tenants",
        type=int,
        help="LookupStream calls of all-tenant tokens (node agents, routers) (4096)",
    )
    parser.add_argument(
        "--lookup-listen",
        help="the lookup port, HOST:PORT; 'auto': the gRPC port + 1 on its host (default); 'off'",
    )
    parser.add_argument("--lmdb-map-size-bytes", help="LMDB map of the index, e.g. 8GiB")
    parser.add_argument("--metrics-listen", help="host:port of the Prometheus endpoint")


def _add_token_flags(parser: argparse.ArgumentParser) -> None:
    """How a client of the metadata service finds its token."""
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token-file", type=Path, help="file holding a metadata token")
    token.add_argument(
        "--data-dir",
        type=Path,
        help="data dir of the `kvstore serve` asked: use the operator token it made there",
    )


def _add_check_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate every setting and file as a start would, start nothing; print ok or exit 2",
    )


def _add_node_flags(parser: argparse.ArgumentParser, standalone: bool) -> None:
    if standalone:
        parser.add_argument("--config", type=Path, help="TOML file; settings under [node]")
        parser.add_argument("--metadata-address", help="host:port of the metadata service")
        parser.add_argument(
            "--metadata-token-file", type=Path, help="file holding a `*` metadata token"
        )
        parser.add_argument("--disk-dir", type=Path, help="LMDB disk tier directory (none: off)")
        parser.add_argument(
            "--insecure-transfer",
            action="store_true",
            default=None,
            help="serve transfers without --cluster-secret-file: any process that reaches the "
            "port, other local users included, may read every block",
        )
    parser.add_argument("--node-id", help="this host's name in the cluster (default: hostname)")
    parser.add_argument("--socket-path", type=Path, help="unix socket workers connect to")
    parser.add_argument("--host-capacity-bytes", help="shared-memory arena size, e.g. 8GiB")
    parser.add_argument("--page-size-bytes", help="one block's page, e.g. 32MiB + 128")
    parser.add_argument("--disk-capacity-bytes", help="disk tier size, e.g. 200GiB")
    parser.add_argument("--host-policy", help="eviction policy of the host tier")
    parser.add_argument("--disk-policy", help="eviction policy of the disk tier")
    parser.add_argument("--transfer", choices=["tcp", "ucx", "none"])
    parser.add_argument("--transfer-host", help="address the transfer engine binds")
    parser.add_argument("--transfer-port", type=int)
    parser.add_argument("--advertise-host", help="address other nodes dial (default: bind)")
    parser.add_argument("--node-metrics-listen", help="host:port of the agent's metrics")
    parser.add_argument(
        "--worker-credentials",
        type=Path,
        help="lines 'token:T|uid:N|gid:N TENANTS' (default: this user, every tenant)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        type=Path,
        help="secret every agent shares; authenticates transfers",
    )
    parser.add_argument("--max-workers", type=int, help="worker connections at once (256)")
    parser.add_argument("--max-pins-per-worker", type=int, help="pages one worker may hold")
    parser.add_argument(
        "--tenant-share",
        type=float,
        help="share of the arena one tenant's reserved and pinned pages may hold while "
        "other tenants use it (0.5)",
    )
    parser.add_argument(
        "--reservation-ttl-s", type=float, help="a save not committed by then is released (120)"
    )
    parser.add_argument(
        "--promotion-reserve-pages",
        type=int,
        help="arena pages no save may reserve, kept for promotions from disk (-1: 1/64 with "
        "a disk tier)",
    )
    parser.add_argument("--private-buffer-bytes", help="buffer of each private worker (256MiB)")
    parser.add_argument(
        "--view-max-keys",
        type=int,
        help="keys the cluster view holds (1000000; 0: ask the service)",
    )


def build_parser() -> argparse.ArgumentParser:
    from kvstore.eviction import policy_names

    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="the embedded default: metadata service (LMDB) and a node agent"
    )
    _add_metadata_flags(serve, with_backend=False)
    _add_node_flags(serve, standalone=False)
    _add_check_flag(serve)
    serve.set_defaults(handler=_serve)

    node = commands.add_parser("node", help="run a node agent (the sidecar of a host)")
    _add_node_flags(node, standalone=True)
    _add_check_flag(node)
    node.set_defaults(handler=_node)

    metadata = commands.add_parser("metadata", help="run the metadata service alone")
    _add_metadata_flags(metadata, with_backend=True)
    _add_check_flag(metadata)
    metadata.set_defaults(handler=_metadata)

    stats = commands.add_parser("stats", help="cluster stats from a metadata service")
    stats.add_argument("--address", default="127.0.0.1:50051")
    _add_token_flags(stats)
    stats.add_argument("--tls-ca", type=Path, help="CA certificate to verify the service")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=_stats)

    events = commands.add_parser(
        "events", help="republish the metadata service's block events on ZMQ (vLLM's format)"
    )
    events.add_argument("--zmq", required=True, help="PUB endpoint, e.g. tcp://*:5557")
    events.add_argument("--metadata-address", default="127.0.0.1:50051")
    events.add_argument("--replay", default="", help="ROUTER endpoint for replays by seq")
    events.add_argument("--model", default="kvstore", help="the <model> of kv@<node>@<model>")
    events.add_argument("--tenant", default="", help="one tenant's events (default: every one)")
    _add_token_flags(events)
    events.add_argument("--tls-ca", type=Path, help="CA certificate to verify the service")
    events.add_argument("--block-tokens", type=int, default=0, help="tokens per kvstore block")
    events.add_argument(
        "--bytes-hashes",
        action="store_true",
        help="block hashes as the keys' bytes (vLLM: VLLM_KV_EVENTS_USE_INT_"
        "BLOCK_HASHES=0); default: their last 8 bytes as an int",
    )
    events.add_argument("--json", action="store_true", help="counters as JSON at exit")
    events.set_defaults(handler=_events)

    replay = commands.add_parser("replay", help="replay a Mooncake-format trace through the store")
    replay.add_argument("trace", help="path of a Mooncake JSONL trace")
    replay.add_argument("--policy", default="lru", choices=policy_names())
    replay.add_argument("--capacity-blocks", type=int, required=True)
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.set_defaults(handler=_replay)

    from kvstore.plan.command import add_plan_flags

    plan = commands.add_parser("plan", help="hit ratio, TTFT and $/Mtok per tier configuration")
    add_plan_flags(plan)
    plan.set_defaults(handler=_plan)

    from kvstore.bench.commands import add_bench_commands

    add_bench_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with _stdout_to_stderr(getattr(args, "json", False)):
            result = args.handler(args)
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    _print_result(result, args.json)
    return 0


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    """With --json, stdout carries exactly one JSON object: whatever the work prints meanwhile
    (vLLM logs to stdout, so do child processes that inherit it) goes to stderr, at the file
    descriptor level."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


if __name__ == "__main__":
    sys.exit(main())
