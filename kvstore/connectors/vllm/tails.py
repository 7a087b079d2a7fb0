"""A prompt's tail: its tokens past the last whole chunk that a repeat of the prompt can load,
at the engine's block granularity. Runs in vLLM's scheduler process (the scheduler half and
its lookup thread).

A computed prompt holds its tokens in whole engine blocks up to `stored_tokens` (a partly
filled last block is never stored). A hit may supply every prompt token but the last (vLLM
computes at least one) that those blocks hold: `loadable_tokens`, so a prompt that fills its
last block loads that block too, and vLLM computes its last token alone. Whole chunks cover
the stored blocks up to a chunk boundary; the blocks between it and the stored end are the
tail (where the stored end is a chunk boundary, the whole blocks before the last token: a
prompt that shares all of the last chunk but its last block still loads those), stored as one
block of fewer tokens than a chunk under
`kvstore.keys.tail_key(parent, tail tokens)`: a key of its own person and of exactly those
tokens, so a tail never answers for a whole chunk, and a longer prompt finds a shorter one's
tail only by asking for those tokens. A tail chains on the last whole chunk before it (the
request's root when there is none), so prefix-aware eviction drops it before its parent.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import tail_key

MAX_CANDIDATES = 64  # tail lengths a lookup tries at most (engine blocks per chunk - 1)


def stored_tokens(prompt_tokens: int, block_size: int) -> int:
    """The prompt's tokens in whole engine blocks: what its chunks and tail store."""
    return prompt_tokens // block_size * block_size


def loadable_tokens(prompt_tokens: int, block_size: int) -> int:
    """The most tokens a hit may supply: all but the last prompt token, from whole blocks (not
    a multiple of the block size where the prompt fills its last block)."""
    return min(max(0, prompt_tokens - 1), stored_tokens(prompt_tokens, block_size))


def tail_end(prompt_tokens: int, chunk_tokens: int, block_size: int) -> int:
    """Where a computed prompt's tail ends: at its stored tokens; where those end on a chunk
    boundary (its last chunk is stored whole), at the whole blocks before its last token."""
    end = stored_tokens(prompt_tokens, block_size)
    if end % chunk_tokens == 0:
        return max(0, prompt_tokens - 1) // block_size * block_size
    return end


def covered_tokens(tokens: int, block_size: int) -> int:
    """The tokens of the whole blocks that hold `tokens` (the blocks a load fills)."""
    return -(-tokens // block_size) * block_size


def tail_candidates(
    token_ids: Sequence[int],
    chain_keys: Sequence[bytes],
    root: bytes | None,
    chunks: int,
    chunk_tokens: int,
    block_size: int,
) -> list[tuple[bytes, int]]:
    """(tail key, engine blocks) of every tail that may follow the first `chunks` whole chunks
    within the stored tokens, longest first; [] when none fits or nothing chains it."""
    start = chunks * chunk_tokens
    room = min(chunk_tokens - block_size, stored_tokens(len(token_ids), block_size) - start)
    parent = chain_keys[chunks - 1] if chunks else root
    if parent is None or room < block_size:
        return []
    blocks = range(room // block_size, 0, -1)
    return [
        (tail_key(parent, token_ids[start : start + count * block_size]), count)
        for count in blocks[:MAX_CANDIDATES]
    ]


def prompt_tail(
    token_ids: Sequence[int],
    chain_keys: Sequence[bytes],
    root: bytes | None,
    chunk_tokens: int,
    block_size: int,
) -> tuple[bytes, int, int] | None:
    """(tail key, whole chunks before it, engine blocks) of the tail a computed prompt saves,
    or None (nothing chains it, or no block is left: `tail_end`)."""
    end = tail_end(len(token_ids), chunk_tokens, block_size)
    chunks, rest = divmod(end, chunk_tokens)
    parent = chain_keys[chunks - 1] if chunks else root
    if not rest or parent is None:
        return None
    tokens = token_ids[chunks * chunk_tokens : end]
    return tail_key(parent, tokens), chunks, rest // block_size
