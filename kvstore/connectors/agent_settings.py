"""The settings every connector has: which node agent it reaches, as whom, for which tenant,
and how it waits for answers. Each connector's settings class extends one of these; runs
wherever a connector is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.client import DEFAULT_ANSWER_SPIN_US, MAX_ANSWER_SPIN_US
from kvstore.errors import ConfigError
from kvstore.settings import setting


@dataclass(frozen=True)
class AgentSettings:
    """How a connector reaches its host's node agent; refused when it names no socket or no
    tenant."""

    socket_path: str = setting("/run/kvstore/agent.sock", help="the host's node agent")
    credential_file: str = setting(
        "", help="a token the agent maps to tenants; empty: this process's uid"
    )
    tenant: str = setting("default", help="the tenant whose keys this engine reads and writes")
    salt: str = setting("", help="isolates deployments that must never share KV")
    load_timeout_s: float = setting(
        10.0, help="how long a load may wait for blocks from other hosts", ge=0
    )
    answer_spin_us: int = setting(
        DEFAULT_ANSWER_SPIN_US,
        help="polling for the agent's answer (client.py); 0: sleep at once",
        ge=0,
        le=MAX_ANSWER_SPIN_US,
    )

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ConfigError("socket_path must name the node agent's unix socket")
        if not self.tenant:
            raise ConfigError("tenant must not be empty")


@dataclass(frozen=True)
class ReconnectingAgentSettings(AgentSettings):
    """A connector that keeps one client and reconnects it (SGLang's backend, LMCache's
    adapter): how often it may reconnect, and how long one call may take."""

    reconnect_interval_s: float = setting(
        1.0, help="the least time between two reconnect attempts", ge=0
    )
    timeout_s: float = setting(30.0, help="one control call to the agent", ge=0)
