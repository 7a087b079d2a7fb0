"""The adapter's settings (`adapter_params` of LMCache's plugin L2 adapter), validated once.

Runs in the `lmcache server` process when LMCache builds the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvstore.connectors.agent_settings import ReconnectingAgentSettings
from kvstore.settings import parse_values, settings_of


@dataclass(frozen=True)
class KVStoreL2AdapterConfig(ReconnectingAgentSettings, L2AdapterConfigBase):
    """Fields of `adapter_params` (docs/lmcache.md); unknown keys and mistyped values are
    refused. LMCache's plugin loader finds this class by the adapter's class name + "Config"."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        return cls(**parse_values(cls, d, "the kvstore adapter's adapter_params"))

    @classmethod
    def help(cls) -> str:
        return "kvstore L2 adapter fields (adapter_params): " + ", ".join(
            f"{s.name} (default {s.default!r}): {s.spec.help}" for s in settings_of(cls)
        )
