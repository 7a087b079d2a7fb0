"""The node agent's control server: a unix socket, one thread and one WorkerSession per
connected worker. Requests are answered in order; errors come back as AgentError with the
gRPC status name of their class. Runs in the node agent process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore import errors, framing
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.metadata.service import status_for
from kvstore.node.session import WorkerSession
from kvstore.v1 import agent_pb2 as pb

logger = logging.getLogger(__name__)
MAX_KEYS_PER_CALL = 65536


def _keys(raw: list[bytes]) -> list[BlockKey]:
    if len(raw) > MAX_KEYS_PER_CALL:
        raise errors.ConfigError(f"{len(raw)} keys in one call; the limit is {MAX_KEYS_PER_CALL}")
    if any(len(key) != KEY_BYTES for key in raw):
        raise errors.ConfigError(f"every key must be {KEY_BYTES} bytes")
    return [BlockKey(key) for key in raw]


class ControlServer:
    """Accepts workers on `socket_path`; `make_session` builds each worker's session."""

    def __init__(
        self, socket_path: Path, make_session: Callable[[], WorkerSession], hello: pb.HelloResponse,
        stats_json: Callable[[], str], default_timeout_s: float,
    ) -> None:  # fmt: skip
        self.socket_path = Path(socket_path)
        self.make_session = make_session
        self.hello = hello
        self.stats_json = stats_json
        self.default_timeout_s = default_timeout_s
        self.sessions: set[WorkerSession] = set()
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # a stale socket of a crashed agent
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o660)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(
                target=self._serve, args=(conn,), name="control-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        session = self.make_session()
        with self._lock:
            self.sessions.add(session)
        try:
            while (request := framing.recv_message(conn, pb.AgentRequest)) is not None:
                framing.send_message(conn, self._answer(session, request))
        except (OSError, errors.KVStoreError) as exc:
            logger.info("worker %s disconnected: %s", session.name or "?", exc)
        finally:
            with self._lock:
                self.sessions.discard(session)
                session.close()
            conn.close()

    def _answer(self, session: WorkerSession, request: pb.AgentRequest) -> pb.AgentResponse:
        response = pb.AgentResponse(request_id=request.request_id)
        call = request.WhichOneof("call")
        try:
            if call is None:
                raise errors.ConfigError("empty request: set one call")
            getattr(self, f"_{call}")(session, getattr(request, call), response)
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
        session.name = call.worker
        response.hello.CopyFrom(self.hello)

    def _lookup(self, session, call: pb.LookupKeysRequest, response) -> None:
        local, remote = session.lookup(call.tenant, _keys(call.keys), call.local_only)
        response.lookup.local_hits, response.lookup.remote_hits = local, remote

    def _load(self, session, call: pb.LoadRequest, response) -> None:
        timeout_s = call.timeout_ms / 1000 if call.timeout_ms else self.default_timeout_s
        loaded = session.load(call.tenant, _keys(call.keys), timeout_s)
        out = response.load
        out.load_id = loaded.load_id
        out.pages.extend(loaded.pages)
        out.payload_bytes.extend(h.payload_bytes for h in loaded.headers)
        out.checksums.extend(h.checksum for h in loaded.headers)
        out.local_blocks, out.remote_blocks = loaded.local_blocks, loaded.remote_blocks

    def _release(self, session, call: pb.ReleaseRequest, response) -> None:
        session.release(call.load_id)
        response.release.SetInParent()

    def _save(self, session, call: pb.SaveRequest, response) -> None:
        first_parent = BlockKey(call.first_parent) if call.first_parent else None
        save_id, pages = session.save(
            call.tenant, _keys(call.keys), first_parent, call.payload_bytes, call.layout_hash,
            call.codec_id,
        )  # fmt: skip
        response.save.save_id = save_id
        response.save.reserved.extend(page is not None for page in pages)
        response.save.pages.extend(page or 0 for page in pages)

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
        self.socket_path.unlink(missing_ok=True)
