"""Generates the Python protocol stubs (kvstore/v1/*_pb2*.py) from proto/ with grpcio-tools.

Run by a developer after editing a .proto: `python -m kvstore.codegen`. A test runs it
into a temporary directory and fails when the committed stubs differ (stale).
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

from kvstore.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
GENERATED_PACKAGE = "kvstore/v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / GENERATED_PACKAGE).glob("*.proto"))


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Write the stubs under `out_root`/kvstore/v1 and return their paths."""
    target = out_root / GENERATED_PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    (target / "__init__.py").write_text('"""Generated gRPC/protobuf stubs. Do not edit."""\n')
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *protos,
        ]
    )
    if status != 0:
        raise ConfigError(f"protoc failed with status {status} on {protos}")
    return sorted(target.glob("*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO_ROOT))
    sys.exit(0)
