"""The backend's settings (SGLang's --hicache-storage-backend-extra-config), validated once.

Runs in every SGLang scheduler process (one per TP rank) when the storage backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.codec import CODEC_IDS
from kvstore.connectors.agent_settings import ReconnectingAgentSettings
from kvstore.settings import parse_values, setting

# Keys of the extra config that SGLang itself reads (the dynamic loader and the controller) or
# adds (file_storage_path, from --file-storage-path, given to every backend).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "interface_v2",
        "file_storage_path",
    }
)


@dataclass(frozen=True)
class BackendSettings(ReconnectingAgentSettings):
    """Extra-config fields of the kvstore backend (docs/sglang.md); unknown keys are refused."""

    codec: str = setting(
        "raw",
        help="raw (the pool's dtype) | fp8 (MHA with a 16/32-bit KV dtype)",
        choices=tuple(CODEC_IDS),
    )
    model_path: str = setting(
        "", help="fingerprinted for the namespace; empty: SGLang's model name"
    )
    model_revision: str = setting("", help="mixed into the model fingerprint")
    head_group_size: int = setting(
        0, help="kv heads per stored block, fleet-wide; 0: this rank's heads", ge=0
    )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendSettings:
        extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        return cls(**parse_values(cls, extra, "--hicache-storage-backend-extra-config"))
