"""The connector's settings (kv_connector_extra_config), validated once, and the namespace and
KV layout they imply. Runs in both halves of the connector at construction.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from connectors.vllm import compat
from kvstore.errors import ConfigError
from kvstore.fingerprint import model_fingerprint
from kvstore.keys import Namespace
from kvstore.layout import KVLayout


@dataclass(frozen=True)
class ConnectorSettings:
    """kv_connector_extra_config fields."""

    socket_path: str = "/run/kvstore/agent.sock"  # the host's node agent
    credential_file: str = ""  # a token the agent maps to tenants; empty: this process's uid
    chunk_tokens: int = 256  # a multiple of vLLM's block size
    tenant: str = "default"
    salt: str = ""  # isolates deployments that must never share KV
    codec: str = "raw"  # raw | fp8
    model_revision: str = ""  # mixed into the model fingerprint
    load_timeout_s: float = 10.0
    verify_checksums: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(extra) - set(known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; valid: {sorted(known)}"
            )
        try:
            values = {name: _coerce(value, known[name]) for name, value in extra.items()}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        settings = cls(**values)
        if settings.chunk_tokens <= 0:
            raise ConfigError("chunk_tokens must be positive")
        return settings


def _coerce(value: Any, type_name: str) -> Any:
    if type_name == "bool" and isinstance(value, str):
        return value.lower() in ("1", "true", "yes")
    return {"int": int, "float": float, "bool": bool, "str": str}[type_name](value)


@dataclass(frozen=True)
class EngineKV:
    """What a connector half derives from vLLM's config: layout, namespace, block size."""

    layout: KVLayout
    namespace: Namespace
    block_size: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.chunk_tokens // self.block_size

    def rank_key(self, chain_key: bytes) -> bytes:
        """The key this TP rank stores a chunk under. The scheduler chains keys once (it speaks
        for rank 0); each rank derives its own from them, so ranks never share a shard."""
        if not chain_key:
            return b""
        digest = hashlib.blake2b(chain_key, digest_size=16, key=self.namespace.root_key())
        return digest.digest()


def engine_kv(vllm_config, settings: ConnectorSettings) -> EngineKV:
    block_size = vllm_config.cache_config.block_size
    if settings.chunk_tokens % block_size:
        raise ConfigError(
            f"chunk_tokens {settings.chunk_tokens} must be a multiple of vLLM's block size "
            f"{block_size}; set kv_connector_extra_config.chunk_tokens accordingly"
        )
    num_layers, kv_heads, head_dim, dtype = compat.kv_shape(vllm_config)
    layout = KVLayout(num_layers, kv_heads, head_dim, dtype, settings.chunk_tokens, settings.codec)
    model = vllm_config.model_config
    fingerprint = model_fingerprint(
        Path(model.model), settings.model_revision or model.revision or "",
        compat.kv_affecting_settings(vllm_config),
    )  # fmt: skip
    namespace = Namespace(
        model_fingerprint=fingerprint,
        layout_id=f"{layout.layout_id}|{compat.paged_layout_id(vllm_config)}",
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=compat.tp_rank(vllm_config), tenant=settings.tenant, salt=settings.salt,
    )  # fmt: skip
    return EngineKV(layout, namespace, block_size)
