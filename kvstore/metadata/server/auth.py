"""Bearer-token authentication and tenant scoping for the metadata service; TLS credentials.

Runs in the metadata service process. A token maps to one tenant, or to "*" (every tenant:
node agents and operators); a token may also be bound to one node id (`node=ID`), so the node
agent holding it can register, heartbeat, publish and unpublish as that node only. On
Kubernetes, agents may instead present projected service-account tokens, each bound to its own
node by a TokenReview (kube_tokens.py). With neither configured, authentication is off.
"""

from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import AuthError, ConfigError, PermissionDeniedError
from kvstore.metadata import wire

if TYPE_CHECKING:
    from kvstore.metadata.server.kube_tokens import KubeAgentTokens

ALL_TENANTS = "*"


@dataclass(frozen=True)
class TenantScope:
    """What one caller may touch."""

    tenant: str  # ALL_TENANTS or one tenant
    node: str | None = None  # the only node id it may act as (None: any)

    def require_node(self, node_id: str, action: str) -> None:
        """A node-bound token acts as its own node only (another node's agent, compromised,
        cannot take over a live node's id or drop its holdings)."""
        if self.node is not None and node_id != self.node:
            raise PermissionDeniedError(
                f"this token is bound to node {self.node!r}: it cannot {action} as {node_id!r}"
            )

    def require(self, tenant: str) -> None:
        if self.tenant != ALL_TENANTS and tenant != self.tenant:
            raise PermissionDeniedError(f"this token may only act for tenant {self.tenant!r}")

    def check_tenant(self, tenant: str) -> str:
        """`tenant`, once it is a well-formed name (else ConfigError) this scope may act for
        (else PermissionDeniedError)."""
        wire.check_name(tenant, "tenant")
        self.require(tenant)
        return tenant

    def require_all_tenants(self, action: str) -> None:
        if self.tenant != ALL_TENANTS:
            raise PermissionDeniedError(f"a token scoped to tenant {self.tenant!r} cannot {action}")


class TokenAuth:
    """Checks `authorization: Bearer <token>` metadata against a token → scope table (a bare
    tenant name is that tenant's scope), then, where configured, as an agent's Kubernetes
    token. Runs on the service's loop: `authorize` may wait for a TokenReview, never blocks."""

    def __init__(
        self, tokens: dict[str, TenantScope | str], agents: KubeAgentTokens | None = None
    ) -> None:
        self._tokens = [
            (token.encode(), scope if isinstance(scope, TenantScope) else TenantScope(scope))
            for token, scope in tokens.items()
        ]
        self.agents = agents

    @property
    def enabled(self) -> bool:
        return bool(self._tokens) or self.agents is not None

    async def authorize(self, context: grpc.ServicerContext) -> TenantScope:
        if not self.enabled:
            return TenantScope(ALL_TENANTS)
        presented = _bearer_token(context)
        if presented is None:
            raise AuthError("missing 'authorization: Bearer <token>' metadata")
        return await self.authorize_token(presented)

    async def authorize_token(self, presented: bytes) -> TenantScope:
        """The scope of a token presented outside gRPC metadata (the lookup port's hello)."""
        scope = self.scope_now(presented)
        if scope is None:
            scope = await self.agents.scope(presented)
        return scope

    def scope_now(self, presented: bytes) -> TenantScope | None:
        """The scope of a token known without waiting: a table's token, or an agent token
        reviewed lately; None: it needs a review (`authorize_token`). AuthError: refused."""
        if not self.enabled:
            return TenantScope(ALL_TENANTS)
        if not presented:
            raise AuthError("no bearer token presented")
        for token, scope in self._tokens:  # compare all, in constant time each
            if hmac.compare_digest(token, presented):
                return scope
        if self.agents is None:
            raise AuthError("the bearer token is not valid")
        return self.agents.cached(presented)

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()


def _bearer_token(context: grpc.ServicerContext) -> bytes | None:
    for name, value in context.invocation_metadata() or ():
        if name == "authorization":
            scheme, _, token = value.partition(" ")
            return token.encode() if scheme.lower() == "bearer" and token else None
    return None


def load_tokens(path: Path) -> dict[str, TenantScope]:
    """A token file: one `TOKEN TENANT [node=NODE_ID]` a line (`*` for every tenant; a node
    agent's token bound to its node id); # comments."""
    tokens = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        bound = len(parts) == 3 and parts[2].startswith("node=")
        node = parts.pop().removeprefix("node=") if bound else None
        if len(parts) != 2 or len(parts[0]) < 16 or node == "":
            raise ConfigError(
                f"{path}:{number}: expected 'TOKEN TENANT [node=NODE_ID]' with a "
                "token of 16+ characters"
            )
        tokens[parts[0]] = TenantScope(parts[1], node)
    return tokens


def server_credentials(
    cert_file: Path, key_file: Path, client_ca_file: Path | None = None
) -> grpc.ServerCredentials:
    """TLS for the server; with a client CA, clients must present a certificate it signed."""
    ca = client_ca_file.read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key_file.read_bytes(), cert_file.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def server_ssl_context(
    cert_file: Path, key_file: Path, client_ca_file: Path | None = None
) -> ssl.SSLContext:
    """The same TLS as `server_credentials`, for the lookup port (a plain asyncio server)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
