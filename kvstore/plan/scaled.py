"""A trace slice scaled down for CPU engines: every 512-token block becomes `512 / scale` token
ids derived from its hash id (equal ids, equal tokens), and the chunk keys a connector computes
for those prompts. Runs in the `kvstore plan --validate` process.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.keys import Namespace, chunk_keys
from kvstore.plan.tiers import KeyedRequest
from kvstore.plan.traces import PlanTrace
from kvstore.replay import TRACE_BLOCK_TOKENS, block_token_ids

FIRST_TOKEN_ID = 4  # ids below are the tiny Llama's special tokens
NAMESPACE = Namespace(model_fingerprint="plan-validate", layout_id="scaled-trace")


@dataclass(frozen=True)
class ScaledSlice:
    path: str
    prompts: list[list[int]]
    keyed: list[KeyedRequest]  # full chunks; lookups leave one prompt token to compute


def conversation_sample(trace: PlanTrace, stride: int, limit: int) -> PlanTrace:
    """The first `limit` requests of every `stride`-th conversation (requests whose first block
    after the common block 0 has an id divisible by `stride`): a slice that keeps the trace's
    sharing, where its first requests alone would share little (turns come minutes apart)."""

    def root(request) -> int:
        return request.hash_ids[1] if len(request.hash_ids) > 1 else request.hash_ids[0]

    chosen = [r for r in trace.requests if root(r) % stride == 0][:limit]
    return PlanTrace(trace.path, chosen, trace.has_prefix_info)


def scaled_prompt(hash_ids, input_tokens: int, scale: int, vocab_size: int) -> list[int]:
    chunk = TRACE_BLOCK_TOKENS // scale
    tokens = max(1, input_tokens // scale)
    prompt: list[int] = []
    for hash_id in hash_ids:
        ids = block_token_ids(hash_id)[:chunk] % (vocab_size - FIRST_TOKEN_ID) + FIRST_TOKEN_ID
        prompt.extend(ids.tolist())
    return prompt[:tokens]


def scaled_slice(
    trace: PlanTrace, scale: int, max_prompt_tokens: int, vocab_size: int = 512
) -> ScaledSlice:
    """Prompts of the trace's requests at 1/`scale` length (at most `max_prompt_tokens`)."""
    chunk = TRACE_BLOCK_TOKENS // scale
    prompts, keyed = [], []
    for request in trace.requests:
        prompt = scaled_prompt(request.hash_ids, request.input_tokens, scale, vocab_size)
        prompt = prompt[:max_prompt_tokens]
        prompts.append(prompt)
        keyed.append(keyed_prompt(prompt, chunk))
    return ScaledSlice(trace.path, prompts, keyed)


def keyed_prompt(prompt: list[int], chunk_tokens: int) -> KeyedRequest:
    """The store's view of a prompt, as the vLLM connector sees it: keys of its full chunks;
    a lookup may return all but the chunk holding the last prompt token."""
    keys = tuple(chunk_keys(NAMESPACE, prompt, chunk_tokens))
    usable = min(len(keys), (len(prompt) - 1) // chunk_tokens)
    return KeyedRequest(keys, (chunk_tokens,) * len(keys), usable)
