"""Tails' keys and lengths (connectors/vllm/tails.py): what a hit may load past the whole
chunks, at the engine's block granularity, and keys that never name a whole chunk."""

from connectors.vllm.tails import loadable_tokens, prompt_tail, tail_candidates
from kvstore.keys import Namespace, chained_keys, tail_key

CHUNK, BLOCK = 256, 128
ROOT = Namespace("sha256:model", "layout").root_key()


def keys_of(tokens):
    return chained_keys(ROOT, tokens, CHUNK)


def test_a_hit_may_load_all_but_the_last_token_in_whole_blocks():
    assert [loadable_tokens(n, BLOCK) for n in (1, 128, 129, 1700, 1792)] == [0, 0, 128, 1664, 1664]


def test_a_prompt_saves_the_blocks_between_its_last_whole_chunk_and_its_last_token():
    exact, ragged = list(range(1792)), list(range(1700))
    for tokens in (exact, ragged):
        key, chunks, blocks = prompt_tail(tokens, keys_of(tokens), ROOT, CHUNK, BLOCK)
        assert (chunks, blocks) == (6, 1)
        assert key == tail_key(keys_of(tokens)[5], tokens[1536:1664])
    aligned = list(range(1537))  # loadable: 1,536 tokens, 6 whole chunks, nothing after
    assert prompt_tail(aligned, keys_of(aligned), ROOT, CHUNK, BLOCK) is None
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
    shorter = tokens[:1700]  # saved 164 tokens -> 5 blocks of 32 (loadable 1,696)
    key, chunks, blocks = prompt_tail(shorter, keys_of(shorter), ROOT, CHUNK, block)
    assert (key, blocks) in candidates and chunks == 6
    assert tail_candidates(tokens, keys_of(tokens), ROOT, 7, CHUNK, block) == []  # no room left
