"""The `kvstore bench` subcommands: their flags and the call into each benchmark module.

Runs in the user's shell process, under kvstore/cli.py (which prints each result, as one JSON
object with --json); the benchmark modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_SHARED_SHM_HELP = "use the host's /dev/shm, not a private tmpfs (which needs root)"


def _bench_micro(args: argparse.Namespace) -> dict:
    from kvstore.bench.micro import run_micro

    return run_micro(runs=args.runs, quick=args.quick)


def _bench_lookup(args: argparse.Namespace) -> dict:
    from kvstore.bench.lookup import run_lookup

    return run_lookup(runs=args.runs, duration_s=args.duration_s)


def _bench_transfer(args: argparse.Namespace) -> dict:
    from kvstore.bench.transfer import run_transfer

    sizes = tuple(int(size) for size in args.sizes_mib.split(","))
    return run_transfer(runs=args.runs, sizes_mib=sizes, batch=args.batch, ucx=not args.no_ucx)


def _bench_gpu(args: argparse.Namespace) -> dict:
    from kvstore.bench.gpu import run_gpu

    return run_gpu(device=args.device, chunks=args.chunks, runs=args.runs, quick=args.quick)


def _bench_sglang(args: argparse.Namespace) -> dict:
    from kvstore.bench.sglang import run_sglang

    return run_sglang(pages=args.pages, runs=args.runs, quick=args.quick)


def _bench_vllm(args: argparse.Namespace) -> dict:
    from kvstore.bench.vllm import run_vllm

    return run_vllm(runs=args.runs, prompt_tokens=args.prompt_tokens)


def _bench_serve(args: argparse.Namespace) -> dict:
    from kvstore.bench.serve import ServeSpec, run_serve

    return run_serve(
        ServeSpec(
            modes=tuple(args.modes.split(",")),
            concurrencies=tuple(int(c) for c in args.concurrencies.split(",")),
            num_prompts=args.num_prompts,
            num_prefixes=args.num_prefixes,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=args.suffix_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
            kvstore_settings=args.kvstore_settings,
            log_dir=args.log_dir,
        )
    )


def _bench_chaos(args: argparse.Namespace) -> dict:
    from kvstore.bench.chaos import run_chaos

    return run_chaos(
        args.minutes,
        seed=args.seed,
        corrupt_worker=args.corrupt_worker,
        shared_shm=args.shared_shm,
    )


def _bench_soak(args: argparse.Namespace) -> dict:
    from kvstore.bench.soak import run_soak

    return run_soak(
        args.minutes,
        ops_per_s=args.ops_per_s,
        sample_s=args.sample_s,
        shared_shm=args.shared_shm,
        metadata_max_events=args.metadata_max_events,
    )


def _bench_scale(args: argparse.Namespace) -> dict:
    from kvstore.bench.scale import ScaleSpec, run_scale

    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    options = {"trace": args.trace} if args.trace else {}
    return run_scale(
        ScaleSpec(
            nodes=args.nodes,
            keys=args.keys,
            seconds=seconds,
            backend=args.backend,
            agent_processes=args.agent_processes,
            max_rss_mib=args.max_rss_mib,
            lease_ttl_ms=args.lease_ttl_ms,
            **options,
        )
    )


def add_bench_commands(commands) -> None:
    """Register `kvstore bench <name>` for each benchmark under the CLI's subcommands."""
    bench = commands.add_parser("bench", help="benchmarks; each prints JSON with --json")
    benches = bench.add_subparsers(dest="bench", required=True)
    micro = benches.add_parser("micro", help="hashing, tier and codec throughput vs memcpy")
    micro.add_argument("--runs", type=int, default=5, help="repetitions; medians are reported")
    micro.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    micro.add_argument("--json", action="store_true")
    micro.set_defaults(handler=_bench_micro)
    lookup = benches.add_parser("lookup", help="metadata lookups over gRPC vs Redis EXISTS")
    lookup.add_argument("--runs", type=int, default=5, help="repetitions; medians are reported")
    lookup.add_argument("--duration-s", type=float, default=2.0, help="seconds per measurement")
    lookup.add_argument("--json", action="store_true")
    lookup.set_defaults(handler=_bench_lookup)
    transfer = benches.add_parser("transfer", help="block get/put: shm, tcp, ucx, Redis")
    transfer.add_argument("--runs", type=int, default=5, help="repetitions; medians are reported")
    transfer.add_argument("--sizes-mib", default="4,16", help="block sizes, comma-separated")
    transfer.add_argument("--batch", type=int, default=64, help="blocks per get/put")
    transfer.add_argument("--no-ucx", action="store_true", help="skip the ucx engine")
    transfer.add_argument("--json", action="store_true")
    transfer.set_defaults(handler=_bench_transfer)
    gpu = benches.add_parser("gpu", help="the copy engine on a device vs a pinned copy_")
    gpu.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    gpu.add_argument("--chunks", type=int, default=64, help="256-token chunks saved and loaded")
    gpu.add_argument("--runs", type=int, default=3, help="rounds over the six layouts")
    gpu.add_argument("--quick", action="store_true", help="a small model, for smoke tests")
    gpu.add_argument("--json", action="store_true")
    gpu.set_defaults(handler=_bench_gpu)
    sglang = benches.add_parser("sglang", help="SGLang HiCache batch_set_v1/get_v1 vs memcpy")
    sglang.add_argument("--pages", type=int, default=64, help="64-token Llama-3-8B pages")
    sglang.add_argument("--runs", type=int, default=3, help="timed passes; medians reported")
    sglang.add_argument("--quick", action="store_true", help="a small model, for smoke tests")
    sglang.add_argument("--json", action="store_true")
    sglang.set_defaults(handler=_bench_sglang)
    vllm = benches.add_parser("vllm", help="TTFT of a long prompt: cold vs 50 %% / 90 %% cached")
    vllm.add_argument("--runs", type=int, default=5, help="repetitions; medians are reported")
    vllm.add_argument("--prompt-tokens", type=int, default=4096)
    vllm.add_argument("--json", action="store_true")
    vllm.set_defaults(handler=_bench_vllm)
    _add_serve(benches)
    chaos = benches.add_parser("chaos", help="kill and restart processes of a real cluster")
    chaos.add_argument("--minutes", type=float, default=2.0)
    chaos.add_argument("--seed", type=int, default=0, help="kill schedule and key space")
    chaos.add_argument("--corrupt-worker", default="", help=argparse.SUPPRESS)  # tests only
    chaos.add_argument("--shared-shm", action="store_true", help=_SHARED_SHM_HELP)
    chaos.add_argument("--json", action="store_true")
    chaos.set_defaults(handler=_bench_chaos)
    soak = benches.add_parser("soak", help="steady load on a real cluster; resource slopes")
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--ops-per-s", type=float, default=20.0, help="per worker")
    soak.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    soak.add_argument("--shared-shm", action="store_true", help=_SHARED_SHM_HELP)
    soak.add_argument(
        "--metadata-max-events",
        type=int,
        default=0,
        help="the metadata service's event ring size (0: its default)",
    )
    soak.add_argument("--json", action="store_true")
    soak.set_defaults(handler=_bench_soak)
    scale = benches.add_parser("scale", help="one metadata service under a simulated cluster")
    scale.add_argument("--nodes", type=int, default=100)
    scale.add_argument("--keys", type=int, default=1_000_000, help="preloaded before the run")
    scale.add_argument("--minutes", type=float, default=1.0, help="of trace-rate load")
    scale.add_argument("--seconds", type=float, help="instead of --minutes")
    scale.add_argument("--backend", choices=["memory", "lmdb"], default="memory")
    scale.add_argument("--agent-processes", type=int, default=3, help="simulated agents' procs")
    scale.add_argument("--max-rss-mib", type=int, default=6144, help="stop preloading here")
    scale.add_argument("--lease-ttl-ms", type=int, default=10_000, help="of every node")
    scale.add_argument("--trace", type=Path, help="Mooncake JSONL (default: ../shared/traces)")
    scale.add_argument("--json", action="store_true")
    scale.set_defaults(handler=_bench_scale)


def _add_serve(benches) -> None:
    serve = benches.add_parser(
        "serve", help="vllm.benchmarks.serve against servers with kvstore, LMCache and none"
    )
    serve.add_argument(
        "--modes",
        default="none,kvstore,lmcache_mp",
        help="comma-separated, of none, kvstore, lmcache_mp, lmcache_cpu (CUDA only); none is "
        "the baseline every ratio divides by",
    )
    serve.add_argument("--concurrencies", default="1", help="comma-separated --max-concurrency")
    serve.add_argument("--num-prompts", type=int, default=12)
    serve.add_argument("--num-prefixes", type=int, default=12, help="distinct prompt prefixes")
    serve.add_argument("--prefix-tokens", type=int, default=1536)
    serve.add_argument("--suffix-tokens", type=int, default=256)
    serve.add_argument("--output-tokens", type=int, default=4)
    serve.add_argument("--seed", type=int, default=0, help="prompts of concurrency i: seed + i")
    serve.add_argument(
        "--kvstore-settings",
        default="",
        help="JSON: kvstore connector settings beyond the defaults, e.g. "
        "'{\"verify_checksums\": false}'",
    )
    serve.add_argument("--log-dir", type=Path, help="keep every process's log here")
    serve.add_argument("--json", action="store_true")
    serve.set_defaults(handler=_bench_serve)
