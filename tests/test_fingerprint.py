"""The model fingerprint covers every byte of every weight file (a one-byte change anywhere in
one tensor is another model), the engine settings it is given, and Hugging Face blob names;
digests are cached by stat key, and a file rewritten under an old mtime is hashed again."""

import os
import time

import pytest
import torch
from safetensors.torch import save_file

from kvstore import fingerprint
from kvstore.fingerprint import model_fingerprint


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))


def write_model(directory, seed=0):
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(1 << 20, generator=generator), "b": torch.randn(1 << 20)}
    save_file(tensors, directory / "model.safetensors")  # 8 MiB of data
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


def flip_byte(path, offset):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 1]))


def age(path, seconds=3600):
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_one_byte_anywhere_in_one_tensor_is_another_model(tmp_path):
    model = write_model(tmp_path / "m")
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    flip_byte(model / "model.safetensors", (5 << 20) // 2)  # between the old 1 MiB samples
    assert model_fingerprint(model) != before


def test_kv_settings_and_revision_enter_the_fingerprint(tmp_path):
    model = write_model(tmp_path / "m")
    plain = model_fingerprint(model)
    assert model_fingerprint(model, settings={"kv_cache_dtype": "auto"}) != plain
    assert model_fingerprint(model, settings={"kv_cache_dtype": "fp8"}) != model_fingerprint(
        model, settings={"kv_cache_dtype": "auto"}
    )
    assert model_fingerprint(model, revision="v2") != plain


def test_a_cached_digest_is_reused_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "_RACY_NS", 0)  # the file was just written: cache anyway
    model = write_model(tmp_path / "m")
    weights = model / "model.safetensors"
    age(weights)
    before = model_fingerprint(model)
    assert str(weights) in (fingerprint.cache_dir() / "fingerprints.json").read_text()
    assert model_fingerprint(model) == before
    stat = os.stat(weights)
    time.sleep(0.05)  # past the filesystem's timestamp tick
    flip_byte(weights, 100)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime
    assert model_fingerprint(model) != before, "ctime changed: the file is hashed again"


def test_a_recently_written_file_is_not_cached(tmp_path):
    model = write_model(tmp_path / "m")
    model_fingerprint(model)
    cache = fingerprint.cache_dir() / "fingerprints.json"
    assert not cache.exists() or "model.safetensors" not in cache.read_text()


def test_hugging_face_blobs_are_named_by_their_hashes(tmp_path):
    repo = tmp_path / "models--org--m"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("c" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("a" * 64, "b" * 64):
        (blobs / name).write_bytes(b"weights")  # same bytes: the name is what is trusted
    link = snapshot / "model.safetensors"
    link.symlink_to(blobs / ("a" * 64))
    first = model_fingerprint(snapshot)
    link.unlink()
    link.symlink_to(blobs / ("b" * 64))
    assert model_fingerprint(snapshot) != first


def test_an_unwritable_cache_costs_only_rehashing(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(blocker / "cache"))
    assert model_fingerprint(model).startswith("blake2b:")
