"""The model fingerprint of a namespace: a hash of the model's config and weights, never of its
name alone. Runs in every connector (vLLM's scheduler and workers, SGLang's backend), once at
start.

Hashing every weight byte of a large model would take minutes, so each safetensors file
contributes its size, its header (tensor names, dtypes, shapes, offsets) and three 1 MiB
samples of its data (start, middle, end): two different checkpoints of one architecture
differ in the samples with overwhelming probability.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLE_BYTES = 1 << 20


def model_fingerprint(model_dir: str | Path, revision: str = "") -> str:
    """'blake2b:<hex>' of config.json and the safetensors files under `model_dir`."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16, person=b"kvstore-model1")
    digest.update(revision.encode())
    config = root / "config.json"
    if config.exists():
        canonical = json.dumps(json.loads(config.read_text()), sort_keys=True)
        digest.update(canonical.encode())
    files = sorted(root.glob("*.safetensors"))
    for path in files:
        digest.update(path.name.encode())
        _hash_safetensors(path, digest)
    if not config.exists() and not files:
        digest.update(str(model_dir).encode())  # not a local checkpoint: a hub name/revision
    return f"blake2b:{digest.hexdigest()}"


def _hash_safetensors(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(struct.pack("<Q", size))
    with path.open("rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        digest.update(handle.read(header_bytes))
        data_start = 8 + header_bytes
        for offset in (data_start, (data_start + size) // 2, max(data_start, size - SAMPLE_BYTES)):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
