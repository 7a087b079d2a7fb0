"""The adapter's settings (`adapter_params` of LMCache's plugin L2 adapter), validated once.

Runs in the `lmcache server` process when LMCache builds the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvstore.client import DEFAULT_ANSWER_SPIN_US, check_answer_spin_us
from kvstore.errors import ConfigError
from kvstore.json_settings import parse_fields


@dataclass(frozen=True)
class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """Fields of `adapter_params`; unknown keys and mistyped values are refused. LMCache's
    plugin loader finds this class by the adapter's class name plus "Config"."""

    socket_path: str = "/run/kvstore/agent.sock"  # the host's node agent
    credential_file: str = ""  # a token the agent maps to tenants; empty: this process's uid
    tenant: str = "default"
    salt: str = ""  # isolates deployments (e.g. other weights under one model name)
    load_timeout_s: float = 10.0  # how long a load may wait for blocks from other hosts
    reconnect_interval_s: float = 1.0  # the least time between two reconnect attempts
    timeout_s: float = 30.0  # one control call to the agent
    answer_spin_us: int = DEFAULT_ANSWER_SPIN_US  # polling for the agent's answer (client.py)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        config = cls(**parse_fields(cls, d, "the kvstore adapter's adapter_params"))
        config.validate()
        return config

    @classmethod
    def help(cls) -> str:
        return "kvstore L2 adapter fields (adapter_params): " + ", ".join(
            f"{f.name} (default {f.default!r})" for f in fields(cls)
        )

    def validate(self) -> None:
        if not self.socket_path:
            raise ConfigError("socket_path must name the node agent's unix socket")
        if not self.tenant:
            raise ConfigError("tenant must not be empty")
        for name in ("load_timeout_s", "reconnect_interval_s", "timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_answer_spin_us(self.answer_spin_us)
