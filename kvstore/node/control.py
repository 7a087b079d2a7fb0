"""The node agent's control server: a unix socket, one thread and one WorkerSession per
connected worker. The worker's identity belongs to the connection (SO_PEERCRED, plus the
token of its hello), never to a request; requests are dispatched through one table and
answered in order; errors come back as AgentError with the gRPC status name of their class.
Everything is bounded: workers, frame size and time, pins per worker. Runs in the node agent.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore import errors, framing
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.metadata.status import status_for
from kvstore.node.identity import WorkerCredentials, WorkerIdentity, peer_credentials
from kvstore.node.orphans import OrphanedSessions, open_pidfd
from kvstore.node.session import REMOTE_CODE, WorkerSession
from kvstore.v1 import agent_pb2 as pb

logger = logging.getLogger(__name__)
MAX_KEYS_PER_CALL = 65536
MakeSession = Callable[[WorkerIdentity], WorkerSession]


@dataclass(frozen=True)
class ControlLimits:
    """Bounds of the control socket; see `kvstore node --help`."""

    max_workers: int = 256  # connections at once; more are refused with RESOURCE_EXHAUSTED
    max_frame_bytes: int = 4 << 20  # 65,536 keys of 16 bytes fit 16 times over
    frame_timeout_s: float = 10.0  # a request must arrive whole within this of its first byte
    max_pins_per_worker: int = 65536  # pinned + reserved pages one worker may hold
    orphan_pin_ttl_s: float = 600.0  # pins of a broken connection whose process lives on

    def __post_init__(self) -> None:
        for name in (
            "max_workers",
            "max_frame_bytes",
            "frame_timeout_s",
            "max_pins_per_worker",
            "orphan_pin_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise errors.ConfigError(f"control {name} must be positive")


def _checked_bytes(raw: Sequence[bytes]) -> list[bytes]:
    """The keys of a call, bounded and each KEY_BYTES long (checked in C: lookups pay it)."""
    if len(raw) > MAX_KEYS_PER_CALL:
        raise errors.ConfigError(f"{len(raw)} keys in one call; the limit is {MAX_KEYS_PER_CALL}")
    keys = list(raw)
    if keys and set(map(len, keys)) != {KEY_BYTES}:
        raise errors.ConfigError(f"every key must be {KEY_BYTES} bytes")
    return keys


def _keys(raw: Sequence[bytes]) -> list[BlockKey]:
    return [BlockKey(key) for key in _checked_bytes(raw)]


def secure_socket_dir(directory: Path) -> None:
    """Create the socket's directory (0750), or refuse one that another user could have
    planted or can write: a socket in it could be swapped for an impostor's."""
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise errors.ConfigError(f"socket directory {directory} is not a plain directory")
    if info.st_uid != os.getuid():
        raise errors.ConfigError(
            f"socket directory {directory} belongs to uid {info.st_uid}, not this agent's "
            f"uid {os.getuid()}; remove it or choose another --socket-path"
        )
    if info.st_mode & 0o022:
        raise errors.ConfigError(
            f"socket directory {directory} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); chmod it to 750 or choose another --socket-path"
        )


class ControlServer:
    """Accepts workers on `socket_path`; `make_session` builds each authenticated session."""

    def __init__(
        self,
        socket_path: Path,
        make_session: MakeSession,
        hello: pb.HelloResponse,
        arena_fd: Callable[[], int],
        stats_json: Callable[[], str],
        default_timeout_s: float,
        credentials: WorkerCredentials | None = None,
        limits: ControlLimits | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.make_session = make_session
        self.hello = hello
        self.arena_fd = arena_fd  # a new descriptor of the arena for each shared worker
        self.stats_json = stats_json
        self.default_timeout_s = default_timeout_s
        self.credentials = credentials or WorkerCredentials.owner_only()
        self.limits = limits or ControlLimits()
        self.sessions: set[WorkerSession] = set()
        self.connections = 0
        self.refused = {"workers": 0, "auth": 0, "frames": 0, "orphan_pins": 0}
        self.orphans = OrphanedSessions(self.limits.orphan_pin_ttl_s)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        secure_socket_dir(self.socket_path.parent)
        self.socket_path.unlink(missing_ok=True)  # a stale socket of a crashed agent
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o660)
        listener.listen(64)
        self._listener = listener
        self.orphans.start()
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                admitted = self.connections < self.limits.max_workers
                self.connections += admitted
                self.refused["workers"] += not admitted
            if not admitted:
                _refuse(
                    conn,
                    "RESOURCE_EXHAUSTED",
                    f"{self.limits.max_workers} workers are "
                    "connected, the agent's limit (max_workers)",
                )
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="control-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = peer_credentials(conn)
        pidfd = open_pidfd(peer.pid)
        session = None
        try:
            session = self._handshake(conn, peer)
            if session is not None:
                self._answer_until_closed(conn, session)
        finally:
            conn.close()
            with self._lock:
                self.connections -= 1
                if session is not None:
                    self.sessions.discard(session)
            if session is not None:
                self.orphans.adopt(session, pidfd)  # pins outlive the connection, not the worker
            elif pidfd is not None:
                os.close(pidfd)

    def _handshake(self, conn: socket.socket, peer) -> WorkerSession | None:
        """Read the hello and authenticate; None (connection to close) if that fails."""
        request = None
        try:
            request = self._recv(conn, idle_timeout_s=self.limits.frame_timeout_s)
            if request is None:
                return None
            if request.WhichOneof("call") != "hello":
                raise errors.AuthError("the first call on a connection must be hello")
            identity = self.credentials.identify(peer, request.hello.credential)
            self._require_orphan_room(identity)
        except (OSError, errors.KVStoreError) as exc:
            with self._lock:
                self.refused[_refusal(exc)] += 1
            logger.warning("refusing worker pid %d uid %d: %s", peer.pid, peer.uid, exc)
            _refuse(conn, status_for(exc).name, str(exc), getattr(request, "request_id", 0))
            return None
        session = self.make_session(identity)
        session.name = request.hello.worker
        with self._lock:
            self.sessions.add(session)
        framing.send_message(conn, self._answer(session, request))
        self._send_mapping(conn, session)
        return session

    def _require_orphan_room(self, identity) -> None:
        """A worker whose broken connections still hold max_pins_per_worker pages connects
        again once its process exits or their pins time out (reconnecting held any number)."""
        held = self.orphans.pages_held_by(identity)
        if held >= self.limits.max_pins_per_worker:
            raise errors.CapacityError(
                f"this worker's broken connections ({identity.via}) still hold {held} pages, "
                f"the limit per worker; they are freed when its process exits, or after "
                f"{self.limits.orphan_pin_ttl_s:.0f} s"
            )

    def _send_mapping(self, conn: socket.socket, session: WorkerSession) -> None:
        """The descriptor the worker maps, right after the hello: the arena, or its buffer."""
        if session.private is not None:
            socket.send_fds(conn, [b"\0"], [session.private.fd])
            return
        fd = self.arena_fd()
        try:
            socket.send_fds(conn, [b"\0"], [fd])
        finally:
            os.close(fd)

    def _answer_until_closed(self, conn: socket.socket, session: WorkerSession) -> None:
        try:
            while (request := self._recv(conn)) is not None:
                framing.send_message(conn, self._answer(session, request))
        except (OSError, errors.KVStoreError) as exc:
            if isinstance(exc, errors.ConfigError | framing.FrameTimeoutError):
                with self._lock:
                    self.refused["frames"] += 1
            logger.info("worker %s disconnected: %s", session.name or "?", exc)

    def _recv(self, conn: socket.socket, idle_timeout_s: float | None = None):
        """The next request. A worker may idle as long as it likes between requests; before
        its hello, only `idle_timeout_s` (a silent connection holds no slot for long)."""
        conn.settimeout(idle_timeout_s)
        return framing.recv_message(
            conn, pb.AgentRequest, self.limits.max_frame_bytes, self.limits.frame_timeout_s
        )

    def _answer(self, session: WorkerSession, request: pb.AgentRequest) -> pb.AgentResponse:
        response = pb.AgentResponse(request_id=request.request_id)
        call = request.WhichOneof("call")
        try:
            handler = _CALLS.get(call)
            if handler is None:
                raise errors.ConfigError("empty request: set one call")
            handler(self, session, getattr(request, call), response)
        except errors.KVStoreError as exc:
            response.error.code = status_for(exc).name
            response.error.message = str(exc)
        except Exception as exc:
            logger.exception("control call %s failed", call)
            response.error.code = "INTERNAL"
            response.error.message = f"{type(exc).__name__}: {exc}"
        return response

    # ---- calls ---------------------------------------------------------------------------
    def _hello(self, session, call: pb.HelloRequest, response) -> None:
        response.hello.CopyFrom(self.hello)
        response.hello.tenants.extend(sorted(session.identity.tenants))
        if session.private is None:
            response.hello.access = "shared"
            response.hello.mapping_bytes = self.hello.num_pages * self.hello.page_size_bytes
        else:
            response.hello.access = "private"
            response.hello.mapping_bytes = session.private.size_bytes

    def _lookup(self, session, call: pb.LookupKeysRequest, response) -> None:
        # plain bytes: a lookup only tests membership, and BlockKey hashes and compares as bytes
        keys = _checked_bytes(call.keys)
        tiers = session.lookup(call.tenant, keys, call.local_only, call.chunk_tokens)
        remote = tiers.count(REMOTE_CODE)
        out = response.lookup
        out.local_hits, out.remote_hits, out.tiers = len(tiers) - remote, remote, tiers

    def _load(self, session, call: pb.LoadRequest, response) -> None:
        timeout_s = call.timeout_ms / 1000 if call.timeout_ms else self.default_timeout_s
        loaded = session.load(call.tenant, _keys(call.keys), timeout_s)
        out = response.load
        out.load_id = loaded.load_id
        out.offsets.extend(loaded.offsets)
        out.payload_bytes.extend(h.payload_bytes for h in loaded.headers)
        out.checksums.extend(h.checksum for h in loaded.headers)
        out.local_blocks, out.remote_blocks = loaded.local_blocks, loaded.remote_blocks

    def _release(self, session, call: pb.ReleaseRequest, response) -> None:
        session.release(call.load_id, call.suspect)
        response.release.SetInParent()

    def _save(self, session, call: pb.SaveRequest, response) -> None:
        first_parent = BlockKey(call.first_parent) if call.first_parent else None
        save_id, offsets = session.save(
            call.tenant,
            _keys(call.keys),
            first_parent,
            call.payload_bytes,
            call.layout_hash,
            call.codec_id,
        )
        response.save.save_id = save_id
        response.save.reserved.extend(offset is not None for offset in offsets)
        response.save.offsets.extend(offset or 0 for offset in offsets)

    def _commit(self, session, call: pb.CommitRequest, response) -> None:
        if call.checksums and len(call.checksums) != len(call.keys):
            raise errors.ConfigError("checksums, when given, must match keys one to one")
        response.commit.committed = session.commit(call.save_id, _keys(call.keys), call.checksums)

    def _abort(self, session, call: pb.AbortRequest, response) -> None:
        session.abort(call.save_id)
        response.abort.SetInParent()

    def _stats(self, session, call: pb.AgentStatsRequest, response) -> None:
        response.stats.json = self.stats_json()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self.orphans.stop()
        self.socket_path.unlink(missing_ok=True)


_CALLS = {
    "hello": ControlServer._hello,
    "lookup": ControlServer._lookup,
    "load": ControlServer._load,
    "release": ControlServer._release,
    "save": ControlServer._save,
    "commit": ControlServer._commit,
    "abort": ControlServer._abort,
    "stats": ControlServer._stats,
}


def _refusal(exc: Exception) -> str:
    """The `refused` counter a failed handshake counts into."""
    if isinstance(exc, errors.AuthError):
        return "auth"
    return "orphan_pins" if isinstance(exc, errors.CapacityError) else "frames"


def _refuse(conn: socket.socket, code: str, message: str, request_id: int = 0) -> None:
    """Answer with an error and close: the worker sees why, not a bare hang-up."""
    response = pb.AgentResponse(request_id=request_id)
    response.error.code, response.error.message = code, message
    try:
        conn.settimeout(1.0)
        framing.send_message(conn, response)
    except OSError:
        pass
    conn.close()
