"""`kvstore plan`'s flags: declared, turned into PlanOptions once, and run. Runs in the
`kvstore plan` process; kvstore/cli.py only registers the subcommand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.plan import options as opts
from kvstore.plan.progress import MODES, progress_bar

DEFAULT_TIERS = "dram=0,128GiB,512GiB,2TiB;nvme=0,4TiB,16TiB;nodes=1"


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="Mooncake JSONL or Azure 2023 CSV trace")
    parser.add_argument(
        "--model", default="llama-3-8b", help="config.json path or preset (llama-3-8b, llama-3-70b)"
    )
    parser.add_argument(
        "--tiers",
        default=DEFAULT_TIERS,
        help=f"candidate sizes per node (default {DEFAULT_TIERS!r})",
    )
    parser.add_argument("--codecs", default="raw,fp8", help="KV codecs to compare (raw, fp8)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of an instance")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--prices",
        default="",
        help="gpu_hour=,dram_gb_month=,nvme_gb_month= "
        f"(USD; defaults {opts.DEFAULT_PRICES}; sources: kvstore/plan/options.py)",
    )
    parser.add_argument(
        "--bandwidths",
        default="",
        help="host= (per GPU), disk=, remote= (per "
        f"node), bytes/s; defaults {opts.DEFAULT_BANDWIDTHS}",
    )
    parser.add_argument(
        "--bandwidths-from",
        type=Path,
        nargs="*",
        default=[],
        help="kvstore bench transfer / micro JSON outputs",
    )
    parser.add_argument("--gpu-tflops", type=float, default=opts.DEFAULT_GPU_TFLOPS)
    parser.add_argument("--mfu", type=float, default=opts.DEFAULT_MFU)
    parser.add_argument(
        "--prefill-from", type=Path, help="kvstore bench vllm JSON: calibrate the prefill FLOP/s"
    )
    parser.add_argument("--sla-ttft-s", type=float, default=2.0, help="TTFT p90 target")
    parser.add_argument("--host-policy", default="lru")
    parser.add_argument("--disk-policy", default="lru")
    parser.add_argument(
        "--serial-loads", action="store_true", help="loads do not overlap compute (CPU engines)"
    )
    parser.add_argument("--limit", type=int, help="only the first N requests of the trace")
    parser.add_argument("--plot", type=Path, help="write PNG figures into this directory")
    parser.add_argument(
        "--validate", action="store_true", help="predicted vs measured on real vLLM engines + agent"
    )
    parser.add_argument("--requests", type=int, default=240, help="--validate: trace requests")
    parser.add_argument(
        "--progress",
        choices=MODES,
        default="auto",
        help="progress bar on stderr: auto (when stderr is a terminal), always, never",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", type=Path, help="also write that JSON object to a file")


def build_options(args: argparse.Namespace) -> opts.PlanOptions:
    from kvstore.eviction import make_policy

    tiers = opts.parse_tiers(args.tiers)
    codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip())
    for name, value in (("--tp", args.tp), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    for name, value in (
        ("--sla-ttft-s", args.sla_ttft_s),
        ("--gpu-tflops", args.gpu_tflops),
        ("--mfu", args.mfu),
    ):
        if not value > 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    make_policy(args.host_policy), make_policy(args.disk_policy)  # unknown names fail here
    bandwidths = opts.parse_pairs(args.bandwidths, opts.DEFAULT_BANDWIDTHS, "--bandwidths")
    bandwidths = opts.bandwidths_from_bench(args.bandwidths_from, bandwidths)
    defaults = opts.PlanOptions()
    return opts.PlanOptions(
        codecs=codecs,
        dram_bytes=tiers.get("dram", defaults.dram_bytes),
        nvme_bytes=tiers.get("nvme", defaults.nvme_bytes),
        nodes=tiers.get("nodes", (1,)),
        tp_size=args.tp,
        gpus_per_node=args.gpus_per_node,
        bandwidths=bandwidths,
        prices=opts.Prices(**opts.parse_pairs(args.prices, opts.DEFAULT_PRICES, "--prices")),
        sla_ttft_s=args.sla_ttft_s,
        gpu_tflops=args.gpu_tflops,
        mfu=args.mfu,
        prefill_flops_per_s=opts.prefill_flops_from_bench(args.prefill_from)
        if args.prefill_from
        else None,
        host_policy=args.host_policy,
        disk_policy=args.disk_policy,
        overlap=not args.serial_loads,
    )


def run_plan_command(args: argparse.Namespace) -> dict | int:
    if args.validate:
        from kvstore.plan.validate import run_validate

        progress = progress_bar(args.progress, 0, "prompt")
        return run_validate(requests=args.requests, trace=args.trace, progress=progress)
    if not args.trace:
        raise ConfigError("a TRACE path is required (or --validate)")
    from kvstore.plan.model import load_model
    from kvstore.plan.report import format_plan
    from kvstore.plan.run import Planner, public_result
    from kvstore.plan.traces import read_trace

    options = build_options(args)
    model = load_model(args.model)
    for codec in options.codecs:
        model.layout(codec, options.tp_size, 512)  # an unknown codec fails before the replay
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    trace = read_trace(args.trace, args.limit)
    progress = progress_bar(args.progress, 0, "req")
    result = Planner(trace, model, options, progress).run()
    if args.plot:
        from kvstore.plan.plots import write_plots

        result["plots"] = write_plots(result, args.plot)
    if args.json_out:
        args.json_out.write_text(json.dumps(public_result(result), indent=1))
    if args.json:
        return public_result(result)
    print(format_plan(result))
    if args.plot:
        print("plots: " + ", ".join(result["plots"]))
    return 0
