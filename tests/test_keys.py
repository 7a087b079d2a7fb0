"""Content-addressed keys: chaining, determinism across processes, namespace isolation."""

import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, Namespace, chunk_keys

NS = Namespace(model_fingerprint="sha256:abc", layout_id="L2-H2-D8-float32-T4-raw")


def test_only_full_chunks_get_keys():
    assert len(chunk_keys(NS, range(11), chunk_tokens=4)) == 2
    assert chunk_keys(NS, range(3), chunk_tokens=4) == []


def test_keys_chain_on_the_whole_prefix():
    a = chunk_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1], "same second chunk after a different first chunk must differ"
    c = chunk_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert c[:2] == a


@pytest.mark.parametrize(
    "other",
    [
        Namespace("sha256:abd", NS.layout_id),
        Namespace(NS.model_fingerprint, "L2-H2-D8-float32-T4-fp8"),
        Namespace(NS.model_fingerprint, NS.layout_id, tenant="other"),
        Namespace(NS.model_fingerprint, NS.layout_id, salt="s"),
    ],
)
def test_same_tokens_in_another_namespace_give_other_keys(other):
    tokens = list(range(8))
    assert set(chunk_keys(NS, tokens, 4)).isdisjoint(chunk_keys(other, tokens, 4))


def test_token_ids_hash_as_int32_whatever_the_input_type():
    as_list = chunk_keys(NS, [1, 2, 3, 4], 4)
    as_int64 = chunk_keys(NS, np.array([1, 2, 3, 4], dtype=np.int64), 4)
    assert as_list == as_int64


_SUBPROCESS = (
    "from kvstore.keys import Namespace, chunk_keys;"
    "ns = Namespace('sha256:abc', 'L2-H2-D8-float32-T4-raw', tenant='t', salt='x');"
    "print(','.join(k.hex() for k in chunk_keys(ns, range(4096), 256)))"
)


def test_keys_are_identical_across_processes_with_different_hash_seeds():
    outputs = {
        subprocess.run(
            [sys.executable, "-c", _SUBPROCESS],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(outputs) == 1
    assert len(outputs.pop().strip().split(",")) == 16


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: chunk_keys(NS, [1.5, 2.0], 2), "integers"),
        (lambda: chunk_keys(NS, [[1, 2]], 2), "one-dimensional"),
        (lambda: chunk_keys(NS, [2**40, 1], 2), "int32"),
        (lambda: chunk_keys(NS, [1, 2], 0), "chunk_tokens"),
        (lambda: Namespace("", "L"), "model_fingerprint"),
        (lambda: BlockKey(b"short"), "16 bytes"),
        (lambda: BlockKey.from_hex("zz"), "hex"),
    ],
)
def test_bad_input_names_what_to_change(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# ---- keys shared with SGLang (kvstore.keys_sglang) ------------------------------------------
def test_page_hashes_are_sglangs_own():
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvstore.keys_sglang import sglang_page_hashes

    tokens = [(i * 7919) % 128_000 for i in range(70)]
    assert sglang_page_hashes(tokens, 16) == get_hash_str(tokens, None, page_size=16)[:4]
    prior = get_hash_str(tokens[:16], None, page_size=16)[0]
    assert sglang_page_hashes(tokens[16:], 16, prior) == get_hash_str(tokens[16:], prior, 16)[:3]
    wide = [5, 2**33, 7, 9]  # an id above uint32: SGLang's tagged uint64 encoding
    assert sglang_page_hashes(wide, 2) == get_hash_str(wide, None, page_size=2)
    assert sglang_page_hashes(np.array(tokens[:32], dtype=np.int32), 16) == get_hash_str(
        tokens[:32], None, page_size=16
    )


def test_salted_chains_start_where_sglangs_do():
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    from kvstore.keys_sglang import sglang_chain_seed

    for extra, salt in ((None, None), (None, "s"), ("lora-1", None), ("a", "b"), ("", "")):
        assert sglang_chain_seed(extra, salt) == storage_namespace_seed(extra, salt)


def test_group_keys_name_what_a_block_holds_not_who_wrote_it():
    from kvstore.keys_sglang import head_groups

    root = NS.root_key()
    tp1 = head_groups(8, 1, 0, 2)
    tp2 = [head_groups(8, 2, rank, 2) for rank in range(2)]
    assert (tp1.first, tp1.count) == (0, 4) and [(g.first, g.count) for g in tp2] == [
        (0, 2),
        (2, 2),
    ]
    page = b"ab" * 32
    assert tp1.keys(root, page) == tp2[0].keys(root, page) + tp2[1].keys(root, page)
    assert len(set(tp1.keys(root, page))) == 4
    assert head_groups(2, 4, 3, 0).first == 1, "tp > heads: ranks 2 and 3 share head 1"


@pytest.mark.parametrize(
    ("heads", "tp", "group", "message"),
    [
        (8, 2, 3, "head_group_size 3 must divide this rank's 4 kv heads"),
        (6, 4, 0, "divide"),
        (8, 2, 8, "must divide this rank's 4"),
    ],
)
def test_a_head_group_size_that_does_not_tile_the_ranks_heads_is_refused(heads, tp, group, message):
    from kvstore.keys_sglang import head_groups

    with pytest.raises(ConfigError, match=message):
        head_groups(heads, tp, 0, group)


def test_page_hashes_refuse_what_sglang_cannot_hash():
    from kvstore.keys_sglang import sglang_page_hashes

    with pytest.raises(ConfigError, match="non-negative"):
        sglang_page_hashes([1, -2], 2)
    with pytest.raises(ConfigError, match="page_tokens"):
        sglang_page_hashes([1, 2], 0)
