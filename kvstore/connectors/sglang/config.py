"""The backend's settings (SGLang's --hicache-storage-backend-extra-config), validated once.

Runs in every SGLang scheduler process (one per TP rank) when the storage backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.client import DEFAULT_ANSWER_SPIN_US, check_answer_spin_us
from kvstore.codec import CODEC_IDS
from kvstore.errors import ConfigError
from kvstore.json_settings import parse_fields

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
class BackendSettings:
    """Extra-config fields of the kvstore backend; unknown keys are refused."""

    socket_path: str = "/run/kvstore/agent.sock"  # the host's node agent
    credential_file: str = ""  # a token the agent maps to tenants; empty: this process's uid
    tenant: str = "default"
    salt: str = ""  # isolates deployments that must never share KV
    codec: str = "raw"  # raw (the pool's dtype) | fp8 (MHA with a 16/32-bit KV dtype)
    model_path: str = ""  # fingerprinted for the namespace; empty: SGLang's model name
    model_revision: str = ""  # mixed into the model fingerprint
    head_group_size: int = 0  # kv heads per stored block, fleet-wide; 0: this rank's heads
    load_timeout_s: float = 10.0  # how long a get may wait for blocks from other hosts
    reconnect_interval_s: float = 1.0  # the least time between two reconnect attempts
    timeout_s: float = 30.0  # one control call to the agent
    answer_spin_us: int = DEFAULT_ANSWER_SPIN_US  # polling for the agent's answer (client.py)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendSettings:
        extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        settings = cls(**parse_fields(cls, extra, "--hicache-storage-backend-extra-config"))
        settings.validate()
        return settings

    def validate(self) -> None:
        if not self.socket_path:
            raise ConfigError("socket_path must name the node agent's unix socket")
        if not self.tenant:
            raise ConfigError("tenant must not be empty")
        if self.codec not in CODEC_IDS:
            raise ConfigError(f"codec {self.codec!r} unknown; use one of {sorted(CODEC_IDS)}")
        for name in ("load_timeout_s", "reconnect_interval_s", "timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_answer_spin_us(self.answer_spin_us)
