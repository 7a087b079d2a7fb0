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


def _metadata_config(args: argparse.Namespace, **forced):
    from kvstore.config import build_config
    from kvstore.sections import METADATA

    flags = {**METADATA.flag_values(args), **forced}
    return build_config(METADATA, args.config, os.environ, flags)


def _node_config(args: argparse.Namespace, **unless_flagged):
    from kvstore.config import build_config
    from kvstore.sections import NODE

    flags = NODE.flag_values(args)
    flags.update((k, v) for k, v in unless_flagged.items() if flags.get(k) is None)
    return build_config(NODE, args.config, os.environ, flags)


# Settings `kvstore serve` sets itself: the metadata service's, and the agent's unless their
# flags are given (over the config file and the environment, like flags).
_SERVE_METADATA_OMITS = frozenset(
    {"backend", "insecure_no_auth", "redis_url", "redis_wait_replicas", "redis_wait_timeout_ms"}
)
_SERVE_NODE_OMITS = frozenset(
    {"metadata_address", "metadata_token_file", "disk_dir", "insecure_transfer"}
)
_SERVE_NODE_DEFAULTS = {"host_capacity_bytes": 1 << 30}
_SERVE_NODE_SHOWN = {**_SERVE_NODE_DEFAULTS, "socket_path": "DATA_DIR/agent.sock"}


def _serve(args: argparse.Namespace) -> int:
    """The embedded default, closed to other local users: its transfer engine and metadata
    service take only the secrets it keeps in its data dir (serve_secrets.py)."""
    from kvstore.serve import run_embedded
    from kvstore.serve_secrets import ServeSecrets

    # never open: the service takes the tokens made below, whatever --listen says
    given = _metadata_config(args, backend="lmdb", insecure_no_auth=True)
    own = ServeSecrets(given.data_dir)
    node = _node_config(
        args,
        **_SERVE_NODE_DEFAULTS,
        disk_dir=given.data_dir / "disk",
        socket_path=given.data_dir / "agent.sock",
        cluster_secret_file=own.cluster_secret_file,
        metadata_token_file=own.agent_token_file,
    )
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


def _add_config_flag(parser: argparse.ArgumentParser, *sections) -> None:
    tables = " and ".join(f"[{section.table}]" for section in sections)
    parser.add_argument("--config", type=Path, help=f"TOML file; settings under {tables}")


def build_parser() -> argparse.ArgumentParser:
    from kvstore.eviction import policy_names
    from kvstore.sections import METADATA, NODE

    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="the embedded default: metadata service (LMDB) and a node agent"
    )
    _add_config_flag(serve, METADATA, NODE)
    METADATA.add_flags(serve, omit=_SERVE_METADATA_OMITS)
    NODE.add_flags(serve, omit=_SERVE_NODE_OMITS, shown_defaults=_SERVE_NODE_SHOWN)
    _add_check_flag(serve)
    serve.set_defaults(handler=_serve)

    node = commands.add_parser("node", help="run a node agent (the sidecar of a host)")
    _add_config_flag(node, NODE)
    NODE.add_flags(node)
    _add_check_flag(node)
    node.set_defaults(handler=_node)

    metadata = commands.add_parser("metadata", help="run the metadata service alone")
    _add_config_flag(metadata, METADATA)
    METADATA.add_flags(metadata)
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
