"""The `kvstore bench` subcommands: each one's flags declared once, as the fields of a settings
dataclass (kvstore/settings.py) whose `run` calls into its benchmark module (by the same
keyword names, where the module takes them as they are).

Runs in the user's shell process, under kvstore/cli.py (which prints each result, as one JSON
object with --json); the benchmark modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kvstore.config import Section
from kvstore.settings import setting

_SHARED_SHM = "use the host's /dev/shm, not a private tmpfs (which needs root)"
_QUICK = "a small model, for smoke tests"


def _runs(default: int = 5, help: str = "repetitions; medians are reported") -> Any:
    return setting(default, help=help, flag=True)


def _flag(default: Any, help: str = "", **spec: Any) -> Any:
    return setting(default, help=help, flag=True, **spec)


def _csv(text: str, kind: type = str) -> tuple:
    return tuple(kind(item) for item in text.split(","))


@dataclass(frozen=True)
class Micro:
    """hashing, tier and codec throughput vs memcpy"""

    runs: int = _runs()
    quick: bool = _flag(False, "small sizes, for smoke tests")

    def run(self) -> dict:
        from kvstore.bench.micro import run_micro

        return run_micro(**asdict(self))


@dataclass(frozen=True)
class Lookup:
    """metadata lookups over gRPC vs Redis EXISTS"""

    runs: int = _runs()
    duration_s: float = _flag(2.0, "per measurement")

    def run(self) -> dict:
        from kvstore.bench.lookup import run_lookup

        return run_lookup(**asdict(self))


@dataclass(frozen=True)
class Transfer:
    """block get/put: shm, tcp, ucx, Redis"""

    runs: int = _runs()
    sizes_mib: str = _flag("4,16", "block sizes, comma-separated")
    batch: int = _flag(64, "blocks per get/put")
    no_ucx: bool = _flag(False, "skip the ucx engine")

    def run(self) -> dict:
        from kvstore.bench.transfer import run_transfer

        sizes = _csv(self.sizes_mib, int)
        return run_transfer(self.runs, sizes_mib=sizes, batch=self.batch, ucx=not self.no_ucx)


@dataclass(frozen=True)
class Gpu:
    """the copy engine on a device vs a pinned copy_"""

    device: str = _flag("cuda", "cuda or cpu")
    chunks: int = _flag(64, "256-token chunks saved and loaded")
    runs: int = _runs(3, "rounds over the six layouts")
    quick: bool = _flag(False, _QUICK)

    def run(self) -> dict:
        from kvstore.bench.gpu import run_gpu

        return run_gpu(**asdict(self))


@dataclass(frozen=True)
class Sglang:
    """SGLang HiCache batch_set_v1/get_v1 vs memcpy"""

    pages: int = _flag(64, "64-token Llama-3-8B pages")
    runs: int = _runs(3, "timed passes; medians reported")
    quick: bool = _flag(False, _QUICK)

    def run(self) -> dict:
        from kvstore.bench.sglang import run_sglang

        return run_sglang(**asdict(self))


@dataclass(frozen=True)
class Vllm:
    """TTFT of a long prompt: cold vs 50 % / 90 % cached"""

    runs: int = _runs()
    prompt_tokens: int = _flag(4096)

    def run(self) -> dict:
        from kvstore.bench.vllm import run_vllm

        return run_vllm(**asdict(self))


@dataclass(frozen=True)
class Serve:
    """vllm.benchmarks.serve against servers with kvstore, LMCache and none"""

    modes: str = _flag(
        "none,kvstore,lmcache_mp",
        "comma-separated, of none, kvstore, lmcache_mp, lmcache_cpu (CUDA only); none is the "
        "baseline every ratio divides by",
    )
    concurrencies: str = _flag("1", "comma-separated --max-concurrency")
    num_prompts: int = _flag(12)
    num_prefixes: int = _flag(12, "distinct prompt prefixes")
    prefix_tokens: int = _flag(1536)
    suffix_tokens: int = _flag(256)
    output_tokens: int = _flag(4)
    seed: int = _flag(0, "prompts of concurrency i: seed + i")
    kvstore_settings: str = _flag(
        "",
        "JSON: kvstore connector settings beyond the defaults, e.g. "
        "'{\"verify_checksums\": false}'",
    )
    log_dir: str = _flag("", "keep every process's log here")

    def run(self) -> dict:
        from kvstore.bench.serve import ServeSpec, run_serve

        return run_serve(
            ServeSpec(
                modes=_csv(self.modes),
                concurrencies=_csv(self.concurrencies, int),
                num_prompts=self.num_prompts,
                num_prefixes=self.num_prefixes,
                prefix_tokens=self.prefix_tokens,
                suffix_tokens=self.suffix_tokens,
                output_tokens=self.output_tokens,
                seed=self.seed,
                kvstore_settings=self.kvstore_settings,
                log_dir=Path(self.log_dir) if self.log_dir else None,
            )
        )


@dataclass(frozen=True)
class Chaos:
    """kill and restart processes of a real cluster"""

    minutes: float = _flag(2.0)
    seed: int = _flag(0, "kill schedule and key space")
    corrupt_worker: str = _flag("", argparse.SUPPRESS)  # tests only
    shared_shm: bool = _flag(False, _SHARED_SHM)

    def run(self) -> dict:
        from kvstore.bench.chaos import run_chaos

        return run_chaos(**asdict(self))


@dataclass(frozen=True)
class Soak:
    """steady load on a real cluster; resource slopes"""

    minutes: float = _flag(10.0)
    ops_per_s: float = _flag(20.0, "per worker")
    sample_s: float = _flag(5.0, "between samples")
    shared_shm: bool = _flag(False, _SHARED_SHM)
    metadata_max_events: int = _flag(0, "the metadata service's event ring size (0: its default)")

    def run(self) -> dict:
        from kvstore.bench.soak import run_soak

        return run_soak(**asdict(self))


@dataclass(frozen=True)
class Scale:
    """one metadata service under a simulated cluster"""

    nodes: int = _flag(100)
    keys: int = _flag(1_000_000, "preloaded before the run")
    minutes: float = _flag(1.0, "of trace-rate load")
    seconds: float | None = _flag(None, "instead of --minutes")
    backend: str = _flag("memory", choices=("memory", "lmdb"))
    agent_processes: int = _flag(3, "simulated agents' processes")
    max_rss_mib: int = _flag(6144, "stop preloading here")
    lease_ttl_ms: int = _flag(10_000, "of every node")
    max_events: int = _flag(1_000_000, "the service's event ring (its default: 100,000)")
    trace: str = _flag("", "Mooncake JSONL (default: ../shared/traces)")

    def run(self) -> dict:
        from kvstore.bench.scale import ScaleSpec, run_scale

        seconds = self.seconds if self.seconds is not None else self.minutes * 60
        options = {"trace": Path(self.trace)} if self.trace else {}
        return run_scale(
            ScaleSpec(
                nodes=self.nodes,
                keys=self.keys,
                seconds=seconds,
                backend=self.backend,
                agent_processes=self.agent_processes,
                max_rss_mib=self.max_rss_mib,
                lease_ttl_ms=self.lease_ttl_ms,
                max_events=self.max_events,
                **options,
            )
        )


@dataclass(frozen=True)
class Eviction:
    """eviction policies' hit ratios vs Belady on a trace's time slice"""

    trace: str = _flag("", "Mooncake JSONL (default: ../shared/traces)")
    policies: str = _flag("lru,prefix-reuse,reuse-interval", "comma-separated")
    capacities: str = _flag("5000,10000,20000,40000", "blocks, comma-separated; '': timing only")
    slice_from: float = _flag(0.0, "fraction of the requests where the slice starts", ge=0, le=1)
    slice_to: float = _flag(1.0, "fraction of the requests where it ends", ge=0, le=1)
    timing_capacity: int = _flag(10_000, "blocks, for the time per access", gt=0)
    timing_runs: int = _runs(3)

    def run(self) -> dict:
        from kvstore.bench.eviction import run_eviction
        from kvstore.bench.scale import DEFAULT_TRACE

        return run_eviction(
            self.trace or str(DEFAULT_TRACE),
            _csv(self.policies),
            _csv(self.capacities, int) if self.capacities else (),
            self.slice_from,
            self.slice_to,
            self.timing_capacity,
            self.timing_runs,
        )


@dataclass(frozen=True)
class Shards:
    """the Redis index on a real 3-master cluster: one slot vs sharded"""

    seconds: float = _flag(10.0, "of publishing, per run", gt=0)
    writers: int = _flag(4, "publishing processes", ge=1)
    shards: int = _flag(12, "of the sharded index", ge=2)
    runs: int = _runs(2)

    def run(self) -> dict:
        from kvstore.bench.shards import run_shards

        return run_shards(**asdict(self))


_BENCHES = (Micro, Lookup, Transfer, Gpu, Sglang, Vllm, Serve, Chaos, Soak, Scale, Eviction, Shards)


def _run(section: Section, args: argparse.Namespace) -> dict:
    return section.load({}, {}, section.flag_values(args)).run()


def add_bench_commands(commands) -> None:
    """Register `kvstore bench <name>` for each benchmark under the CLI's subcommands."""
    bench = commands.add_parser("bench", help="benchmarks; each prints JSON with --json")
    benches = bench.add_subparsers(dest="bench", required=True)
    for cls in _BENCHES:
        name = cls.__name__.lower()
        parser = benches.add_parser(name, help=cls.__doc__.replace("%", "%%"))
        section = Section(cls, f"bench_{name}")
        section.add_flags(parser)
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(handler=partial(_run, section))
