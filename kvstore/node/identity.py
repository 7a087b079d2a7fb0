"""Who a worker on the control socket is, and which tenants it may act for.

Runs in the node agent, once per accepted worker connection. Identity comes from the
connection, never from a request: the kernel's SO_PEERCRED (pid, uid, gid of the process that
connected) and, optionally, a token the worker read from a credential file and presented in
its hello. A credentials file maps either to tenants and to an access mode: `shared` workers
map the host arena (zero copy), `private` ones get copies in a buffer of their own (the
default for a grant of named tenants). Without a file, only the agent's own user (and root)
may connect, shared, for every tenant.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import AuthError, ConfigError, PermissionDeniedError

ALL_TENANTS = "*"
MIN_TOKEN_CHARS = 16
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    pid: int  # 0 when the peer is in a pid namespace this agent cannot see
    uid: int
    gid: int


def peer_credentials(conn: socket.socket) -> PeerCredentials:
    """The kernel's record of the process at the other end of a unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return PeerCredentials(*_PEERCRED.unpack(raw))


@dataclass(frozen=True)
class WorkerIdentity:
    """An authenticated worker: what it proved, and the tenants that grants."""

    peer: PeerCredentials
    tenants: frozenset[str]  # {ALL_TENANTS} for every tenant
    via: str  # "token", "uid:N", "gid:N": how it was authenticated
    shared_arena: bool = True  # maps the host arena itself; False: copies in its own buffer

    def require(self, tenant: str) -> None:
        """Raise PermissionDeniedError unless this worker may act for `tenant`."""
        if ALL_TENANTS not in self.tenants and tenant not in self.tenants:
            allowed = ", ".join(sorted(self.tenants))
            raise PermissionDeniedError(
                f"this worker ({self.via}) may act for tenants [{allowed}], not {tenant!r}"
            )


@dataclass(frozen=True)
class Grant:
    tenants: frozenset[str]
    shared_arena: bool


class WorkerCredentials:
    """The agent's table of who may connect: tokens, uids and gids mapped to grants."""

    def __init__(
        self, tokens: dict[str, Grant], uids: dict[int, Grant], gids: dict[int, Grant]
    ) -> None:
        self._tokens = [(token.encode(), grant) for token, grant in tokens.items()]
        self._uids = uids
        self._gids = gids

    @classmethod
    def owner_only(cls) -> WorkerCredentials:
        """No credentials file: the agent's own user and root act for every tenant."""
        every = Grant(frozenset({ALL_TENANTS}), shared_arena=True)
        return cls({}, {os.getuid(): every, 0: every}, {})

    @classmethod
    def from_file(cls, path: Path) -> WorkerCredentials:
        return cls(*_parse(path))

    def tenants(self) -> frozenset[str]:
        """Every tenant some worker may act for ({ALL_TENANTS} if any may act for all)."""
        grants = [g for _, g in self._tokens] + [*self._uids.values(), *self._gids.values()]
        named = frozenset().union(*(grant.tenants for grant in grants))
        return frozenset({ALL_TENANTS}) if ALL_TENANTS in named else named

    def identify(self, peer: PeerCredentials, token: str) -> WorkerIdentity:
        """The identity of a connected worker; AuthError if it proves nothing this agent
        accepts (a presented token must be valid; it is never ignored)."""
        if token:
            presented = token.encode()
            matches = [
                grant
                for known, grant in self._tokens  # each in constant time
                if hmac.compare_digest(known, presented)
            ]
            if not matches:
                raise AuthError("the worker's credential token is not valid on this agent")
            return _identity(peer, matches[0], "token")
        if peer.uid in self._uids:
            return _identity(peer, self._uids[peer.uid], f"uid:{peer.uid}")
        if peer.gid in self._gids:
            return _identity(peer, self._gids[peer.gid], f"gid:{peer.gid}")
        raise AuthError(
            f"uid {peer.uid} / gid {peer.gid} is not allowed on this agent; present a token "
            "or add the uid/gid to the agent's worker credentials file"
        )


def _identity(peer: PeerCredentials, grant: Grant, via: str) -> WorkerIdentity:
    return WorkerIdentity(peer, grant.tenants, via, grant.shared_arena)


def _parse(path: Path):
    """Lines `token:T TENANTS [shared|private]`, `uid:N ...` or `gid:N ...`; TENANTS is a
    comma list or `*`; `#` starts a comment."""
    tables: dict[str, dict] = {"token": {}, "uid": {}, "gid": {}}
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read worker credentials {path}: {exc}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kind, subject, tenants = _parse_line(line, f"{path}:{number}")
        tables[kind][subject] = tenants
    return tables["token"], tables["uid"], tables["gid"]


def _parse_line(line: str, where: str) -> tuple[str, str | int, Grant]:
    parts = line.split()
    kind, _, subject = parts[0].partition(":") if parts else ("", "", "")
    if len(parts) not in (2, 3) or kind not in ("token", "uid", "gid") or not subject:
        raise ConfigError(
            f"{where}: expected 'token:T', 'uid:N' or 'gid:N', then TENANTS, then optionally "
            "shared or private"
        )
    tenants = frozenset(t for t in parts[1].split(",") if t)
    if not tenants:
        raise ConfigError(f"{where}: name at least one tenant (or *)")
    mode = parts[2] if len(parts) == 3 else ("shared" if ALL_TENANTS in tenants else "private")
    if mode not in ("shared", "private"):
        raise ConfigError(f"{where}: access {mode!r} unknown; use shared or private")
    grant = Grant(tenants, shared_arena=mode == "shared")
    if kind == "token":
        if len(subject) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{where}: a token needs {MIN_TOKEN_CHARS}+ characters")
        return kind, subject, grant
    if not subject.isdigit():
        raise ConfigError(f"{where}: {kind} must be a number, got {subject!r}")
    return kind, int(subject), grant
