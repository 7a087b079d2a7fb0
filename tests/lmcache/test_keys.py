"""kvstore keys of LMCache objects: the same in every process, different whenever any field of
the ObjectKey, the tenant or the salt differs, with no two fields able to stand in for each
other; runs of one scope are the chains the adapter saves and looks up."""

from __future__ import annotations

import subprocess
import sys

from lmcache.v1.distributed.api import ObjectKey

from kvstore.connectors.lmcache.keys import block_key, scope_runs

HASH = bytes(range(32))
KEY = ObjectKey(HASH, "org/model", 3, 0, "")


def test_a_key_is_the_same_in_another_process():
    code = (
        "from lmcache.v1.distributed.api import ObjectKey;"
        "from kvstore.connectors.lmcache.keys import block_key;"
        "print(block_key(ObjectKey(bytes(range(32)), 'org/model', 3, 0, ''), 'default', '').hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == block_key(KEY, "default", "").hex()


def test_every_field_tenant_and_salt_names_another_block():
    variants = [
        block_key(KEY, "default", ""),
        block_key(ObjectKey(HASH[:-1] + b"\x00", "org/model", 3, 0, ""), "default", ""),
        block_key(ObjectKey(HASH, "org/model-2", 3, 0, ""), "default", ""),
        block_key(ObjectKey(HASH, "org/model", 4, 0, ""), "default", ""),
        block_key(ObjectKey(HASH, "org/model", 3, 1, ""), "default", ""),
        block_key(ObjectKey(HASH, "org/model", 3, 0, "user"), "default", ""),
        block_key(KEY, "other-tenant", ""),
        block_key(KEY, "default", "user"),  # the adapter's salt is not a cache salt
    ]
    assert len(set(variants)) == len(variants)
    assert all(len(key) == 16 for key in variants)


def test_runs_split_where_the_scope_changes():
    group_0 = [ObjectKey(bytes([i]), "m", 0, 0) for i in range(3)]
    group_1 = [ObjectKey(bytes([i]), "m", 0, 1) for i in range(2)]
    other_model = [ObjectKey(b"\x09", "n", 0, 0)]
    runs = scope_runs([*group_0, *group_1, *other_model])
    assert runs == [range(0, 3), range(3, 5), range(5, 6)]
    assert scope_runs([]) == []
