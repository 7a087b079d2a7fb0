"""The model fingerprint of a namespace: every byte of a model's weight, code and config files,
plus the engine settings that change its KV, never its name alone. Runs in every connector
process (vLLM's scheduler and workers, SGLang's backend), once at start.

Each file is hashed once (BLAKE2b over 64 MiB segments, in parallel); its digest is cached in
~/.cache/kvstore keyed by path, size, mtime, ctime and inode, so restarts are instant. A file in
a Hugging Face cache (a symlink to blobs/<sha256>) is named by its blob, a hash of its bytes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Weights, remote code and configs; tokenizers, readmes and images do not change KV.
HASHED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".py", ".json")
_BLOB_NAME = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")  # git sha1 (small files), sha256 (LFS)
_CACHE_ENTRIES_MAX = 4096
# A file changed this recently may change again within one timestamp tick, unseen by its stat
# key: its digest is not cached (git's "racily clean" rule).
_RACY_NS = 2_000_000_000
_SEGMENT_BYTES = 64 << 20  # hashed in parallel; a file's digest chains its segments' digests
_READ_BYTES = 4 << 20
_HASH_THREADS_MAX = 8


def model_fingerprint(
    model_dir: str | Path, revision: str = "", settings: Mapping[str, Any] | None = None
) -> str:
    """'blake2b:<hex>' of the files of `model_dir` (or, for a hub name, the commit the local Hugging
    Face cache resolves it to), `revision` and `settings` (JSON-able; what changes KV)."""
    digest = hashlib.blake2b(digest_size=16, person=b"kvstore-model2")
    canonical = json.dumps([revision, dict(settings or {})], sort_keys=True, default=_jsonable)
    digest.update(canonical.encode())
    root = Path(model_dir)
    files = model_files(root) if root.is_dir() else []
    for name, file_digest in file_digests(files).items():
        digest.update(f"{name}={file_digest};".encode())
    if not files:
        digest.update(f"name={model_dir};commit={hub_commit(str(model_dir), revision)}".encode())
    return f"blake2b:{digest.hexdigest()}"


def _jsonable(value: Any) -> Any:
    """Settings values JSON cannot encode, as the same text in every process."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def model_files(root: Path) -> list[Path]:
    """The top-level files of a model directory that can change its KV, sorted by name."""
    return sorted(p for p in root.iterdir() if p.suffix in HASHED_SUFFIXES and p.is_file())


def hub_commit(name: str, revision: str = "") -> str:
    """The commit the local Hugging Face cache holds for `name` at `revision` (vLLM caches the
    config before any connector starts); the name alone, with a warning, when it holds none."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=revision or None)
    except Exception:  # not a repo id at all (an empty or odd name)
        cached = None
    if isinstance(cached, str):
        return Path(cached).parent.name  # .../snapshots/<commit>/config.json
    logger.warning(
        "model %r is neither a directory nor in the Hugging Face cache: its "
        "fingerprint covers its name and revision only",
        name,
    )
    return ""


def file_digests(paths: list[Path]) -> dict[str, str]:
    """name -> content digest of each file: its Hugging Face blob name, a cached digest whose
    stat key still matches, or a fresh hash (under a lock, so the processes of one engine that
    start together read each file once)."""
    out = {p.name: digest for p in paths if (digest := _blob_digest(p))}
    rest = [p for p in paths if p.name not in out]
    if rest:
        with _cache_locked() as cache:
            out.update(_cached_digests(cache, rest))
    return dict(sorted(out.items()))


def _blob_digest(path: Path) -> str:
    if not path.is_symlink():
        return ""
    target = path.resolve()
    if target.parent.name == "blobs" and _BLOB_NAME.match(target.name):
        return f"hf-blob:{target.name}:{target.stat().st_size}"
    return ""


def _cached_digests(cache: dict[str, dict], paths: list[Path]) -> dict[str, str]:
    """Digests of `paths`, from `cache` where their stat keys match; the others are hashed
    (in parallel) and entered in `cache` unless changed too recently to trust their stat."""
    out, stale = {}, []
    for path in paths:
        real = os.path.realpath(path)
        info = os.stat(real)
        key = [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]
        entry = cache.get(real)
        if isinstance(entry, dict) and entry.get("stat") == key and "digest" in entry:
            out[path.name] = str(entry["digest"])
        else:
            stale.append((path.name, real, info, key))
    digests = hash_files([(real, info.st_size) for _, real, info, _ in stale])
    for (name, real, info, key), digest in zip(stale, digests, strict=True):
        out[name] = digest
        cache.pop(real, None)
        if time.time_ns() - max(info.st_mtime_ns, info.st_ctime_ns) > _RACY_NS:
            cache[real] = {"stat": key, "digest": digest}
    return out


def hash_files(files: list[tuple[str, int]]) -> list[str]:
    """'blake2b:<hex>' of each (path, size): a hash of its 64 MiB segments' BLAKE2b digests,
    the segments of all files hashed on a thread pool (hashlib releases the GIL)."""
    segments = [
        (path, offset, min(_SEGMENT_BYTES, size - offset))
        for path, size in files
        for offset in range(0, size, _SEGMENT_BYTES)
    ]
    with ThreadPoolExecutor(min(_HASH_THREADS_MAX, os.cpu_count() or 1)) as pool:
        digests = iter(pool.map(lambda segment: _hash_segment(*segment), segments))
    out = []
    for _, size in files:
        whole = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=32, person=b"kvstore-file2")
        for _ in range(0, size, _SEGMENT_BYTES):
            whole.update(next(digests))
        out.append(f"blake2b:{whole.hexdigest()}")
    return out


def _hash_segment(path: str, offset: int, length: int) -> bytes:
    digest = hashlib.blake2b(digest_size=32, person=b"kvstore-seg1")
    buffer = memoryview(bytearray(_READ_BYTES))
    with open(path, "rb", buffering=0) as handle:
        fd, end = handle.fileno(), offset + length
        while offset < end:
            got = os.preadv(fd, [buffer[: min(_READ_BYTES, end - offset)]], offset)
            if got == 0:
                raise OSError(f"{path} shrank while it was hashed")
            digest.update(buffer[:got])
            offset += got
    return digest.digest()


def cache_dir() -> Path:
    base = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstore"
    )
    return Path(base)


@contextmanager
def _cache_locked():
    """The digest cache, read under an exclusive lock and written back (atomically) on exit;
    an unwritable cache directory only costs rehashing at the next start."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "fingerprints.lock", "a")  # noqa: SIM115 (held across the yield)
    except OSError as exc:
        logger.info("no fingerprint cache (%s): weight files are hashed at every start", exc)
        yield {}
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = _read_cache(directory / "fingerprints.json")
        before = dict(cache)
        yield cache
        if cache != before:
            _write_cache(directory / "fingerprints.json", cache)


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        cache = json.loads(path.read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, cache: dict[str, dict]) -> None:
    entries = dict(list(cache.items())[-_CACHE_ENTRIES_MAX:])  # the newest, in insertion order
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    try:
        temporary.write_text(json.dumps(entries))
        os.replace(temporary, path)
    except OSError as exc:
        logger.info("fingerprint cache not written (%s)", exc)
