"""Inference-engine plugins (vLLM, SGLang); each talks to kvstore through its client API only."""
