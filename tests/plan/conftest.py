"""Fixtures the planner tests share with the vLLM tests: the tiny Llama."""

from tests.vllm.conftest import tiny_llama_fp32  # noqa: F401
