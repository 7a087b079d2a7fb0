"""Tails' keys and lengths (kvstore/connectors/vllm/tails.py): what a hit may load past the whole
chunks, at the engine's block granularity, and keys that never name a whole chunk."""

from kvstore.connectors.vllm.tails import (
    covered_tokens,
    loadable_tokens,
    prompt_tail,
    stored_tokens,
    tail_candidates,
)
from kvstore.keys import Namespace, chained_keys, tail_key

CHUNK, BLOCK = 256, 128
ROOT = Namespace("sha256:model", "layout").root_key()


def keys_of(tokens):
    return chained_keys(ROOT, tokens, CHUNK)


def test_a_hit_may_load_all_but_the_last_token_that_whole_blocks_hold():
    prompts = (1, 128, 129, 1700, 1792)
    assert [stored_tokens(n, BLOCK) for n in prompts] == [0, 128, 128, 1664, 1792]
    # a prompt that fills its last block loads it too: vLLM computes the last token alone
    assert [loadable_tokens(n, BLOCK) for n in prompts] == [0, 127, 128, 1664, 1791]
    assert [covered_tokens(n, BLOCK) for n in (0, 127, 128, 1664, 1791)] == [
        0,
        128,
        128,
        1664,
        1792,
    ]


def test_a_prompt_saves_the_whole_blocks_between_its_last_whole_chunk_and_its_end():
    # 1,792 tokens: 7 whole chunks hold every block; its tail is the blocks before its last
    # token past the 6th, for prompts that share all of the 7th chunk but its last block
    ragged, filled, exact = list(range(1700)), list(range(1664)), list(range(1792))
    for tokens in (ragged, filled, exact):
        key, chunks, blocks = prompt_tail(tokens, keys_of(tokens), ROOT, CHUNK, BLOCK)
        assert (chunks, blocks) == (6, 1)
        assert key == tail_key(keys_of(tokens)[5], tokens[1536:1664])
    aligned = list(range(1537))  # stored: 1,536 tokens, 6 whole chunks, nothing after
    assert prompt_tail(aligned, keys_of(aligned), ROOT, CHUNK, BLOCK) is None
    assert prompt_tail(list(range(256)), keys_of(range(256)), ROOT, CHUNK, BLOCK)[1:] == (0, 1)
    short = list(range(200))  # no whole chunk: the tail chains on the root (or on nothing)
    assert prompt_tail(short, [], ROOT, CHUNK, BLOCK)[1:] == (0, 1)
    assert prompt_tail(short, [], None, CHUNK, BLOCK) is None


def test_a_tail_key_never_names_a_whole_chunk_and_depends_on_every_token():
    tokens = list(range(512))
    chunks = keys_of(tokens)
    assert tail_key(chunks[0], tokens[256:512]) != chunks[1], "not a chunk's key, even whole"
    assert tail_key(chunks[0], tokens[256:384]) != tail_key(chunks[0], tokens[256:383])
    assert tail_key(chunks[0], tokens[256:384]) != tail_key(ROOT, tokens[256:384])


def test_a_longer_prompt_asks_for_each_tail_length_the_shorter_one_may_have_saved():
    block = 32
    tokens = list(range(1800))
    candidates = tail_candidates(tokens, keys_of(tokens), ROOT, 6, CHUNK, block)
    assert [blocks for _, blocks in candidates] == [7, 6, 5, 4, 3, 2, 1]  # shorter than a chunk
    shorter = tokens[:1700]  # saved 164 tokens -> 5 blocks of 32 (stored 1,696)
    key, chunks, blocks = prompt_tail(shorter, keys_of(shorter), ROOT, CHUNK, block)
    assert (key, blocks) in candidates and chunks == 6
    assert tail_candidates(tokens, keys_of(tokens), ROOT, 7, CHUNK, block) == []  # no room left
