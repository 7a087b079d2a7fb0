"""One asyncio connection to one Redis server, on which lookups are pipelined: each call's
commands are written back to back, behind any still unanswered, and their replies matched in
order (RESP parsed by hiredis), so a call costs a write and a read, and no task or lock.

Runs in the metadata service process, on the gRPC loop (redis_lookups.py); built off it from a
redis-py client's settings. Opened at the first call (AUTH and SELECT as the client does); a
reply later than `reply_timeout_s`, a protocol error or a lost connection fails every call
waiting on it (PipeError) and the next call opens another. Bounded by its callers: the lookup
port and LookupStream calls have one lookup each in flight per connection or call.

A pipe given a `Tracker` asks Redis to track what it reads (RESP3, CLIENT TRACKING ON: Redis 6
or later) and hands the tracker each invalidation in the order of the replies, so a value
filled from a reply (`call`'s `fill`, run as the reply is read) is dropped by any later change;
a connection opened or lost resets the tracker (invalidations on it are lost). `drain` reads
what the socket holds now, so a caller about to answer from the tracker first takes every
invalidation Redis has sent. A server that refuses tracking is read without it.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import hiredis
import redis

from kvstore.errors import UnavailableError

CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 2.0  # under a client's default lookup deadline (5 s): it gets the status


class PipeError(UnavailableError):
    """The connection failed (refused, lost, a protocol error): replies of its calls are lost."""


class ReplyLate(PipeError):
    """A reply came no sooner than `reply_timeout_s`: the connection was cut."""


class ReplyError(UnavailableError):
    """Redis answered a command with an error (`reply`: its text, as MOVED 1 host:port)."""

    def __init__(self, message: str, reply: str) -> None:
        super().__init__(message)
        self.reply = reply


def pack_mget(stem: bytes, keys: Sequence[bytes], head: Sequence[bytes] = ()) -> bytes:
    """`MGET *head *(stem + key for key in keys)` in RESP, as hiredis.pack_command writes it:
    where the keys share a length (a lookup's: KEY_BYTES each), one join that never builds the
    names (a 64-key lookup's MGET: ~1 µs, against ~8 µs for the names and their packing)."""
    lengths = set(map(len, keys))
    if len(lengths) != 1:
        return hiredis.pack_command((b"MGET", *head, *(stem + key for key in keys)))
    each = b"$%d\r\n%s" % (len(stem) + lengths.pop(), stem)
    front = b"".join(b"$%d\r\n%s\r\n" % (len(name), name) for name in head)
    names = each + (b"\r\n" + each).join(keys)
    return b"*%d\r\n$4\r\nMGET\r\n%s%s\r\n" % (1 + len(head) + len(keys), front, names)


@dataclass(frozen=True)
class PipeAddress:
    """Where and as whom to connect: host and port, or a unix socket `path`."""

    host: str = ""
    port: int = 0
    path: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0

    @classmethod
    def of(cls, client: redis.Redis) -> PipeAddress | None:
        """The server `client` talks to; None where this pipe cannot speak as it does (TLS,
        a credential provider)."""
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        if kwargs.get("credential_provider") is not None:
            return None
        common = {
            "username": kwargs.get("username"),
            "password": kwargs.get("password"),
            "db": int(kwargs.get("db") or 0),
        }
        if pool.connection_class is redis.UnixDomainSocketConnection:
            return cls(path=kwargs["path"], **common)
        if pool.connection_class is not redis.Connection:
            return None
        host, port = kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))
        return cls(host=host, port=port, **common)

    def name(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    def handshake(self, authenticated: bool = False) -> list[tuple]:
        """The commands a new connection sends first (`authenticated`: by its HELLO)."""
        commands: list[tuple] = []
        if self.password is not None and not authenticated:
            user = () if self.username is None else (self.username,)
            commands.append(("AUTH", *user, self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        return commands


class Tracker(Protocol):
    """What a tracking pipe tells of the values its connection read."""

    def invalidate(self, names: list[bytes] | None) -> None:
        """Redis says these keys changed (None: every key, as at FLUSHALL)."""

    def reset(self) -> None:
        """A connection was opened or lost: nothing read before is tracked any more."""


Fill = Callable[[list], None]  # given a call's replies as they are read, before any later reply


class _Call:
    __slots__ = ("count", "fill", "future", "replies", "timer")

    def __init__(
        self, future: asyncio.Future, count: int, timer: asyncio.TimerHandle, fill: Fill | None
    ) -> None:
        self.future, self.count, self.replies, self.timer = future, count, [], timer
        self.fill = fill


class _Replies(asyncio.Protocol):
    """The connection: calls waiting for their replies, oldest first."""

    def __init__(self, pipe: RedisPipe, sock: socket.socket) -> None:
        self.pipe = pipe
        self.sock = sock  # read by `drain` too
        self.reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[_Call] = collections.deque()
        self.failed: PipeError | None = None
        self.tracking = False  # set once Redis agreed to track this connection's reads

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def send(
        self, packed: bytes, count: int, timeout_s: float, fill: Fill | None = None
    ) -> asyncio.Future:
        loop = self.pipe.loop
        future = loop.create_future()
        timer = loop.call_later(timeout_s, self._late, future, timeout_s)
        self.waiting.append(_Call(future, count, timer, fill))
        self.transport.write(packed)
        return future

    def drain(self) -> bool:
        """Read what the socket holds now (no wait); False where the connection failed."""
        if self.failed is not None:
            return False
        try:
            while data := self.sock.recv(1 << 16):
                self.data_received(data)
                if self.failed is not None:
                    return False
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            self.fail(self.error(f"the connection was lost ({exc})"))
            return False
        self.fail(self.error("the connection was lost (closed by the server)"))  # EOF
        return False

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                if isinstance(reply, hiredis.PushNotification):
                    self._pushed(reply)
                else:
                    self._take(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # IndexError: a reply unasked for
            self.fail(self.error(f"a reply that is not RESP, or was not asked for ({exc!r})"))

    def _pushed(self, push: list) -> None:
        tracker = self.pipe.tracker
        if self.tracking and push and push[0] == b"invalidate" and tracker is not None:
            tracker.invalidate(push[1] if len(push) > 1 else None)
            if self.waiting and self.waiting[0].replies:  # a change amid a call's replies:
                self.waiting[0].fill = None  # those before it may be stale, fill none

    def _take(self, reply) -> None:
        call = self.waiting[0]
        call.replies.append(reply)
        if len(call.replies) == call.count:
            self.waiting.popleft()
            call.timer.cancel()
            if call.fill is not None and self.tracking and not _refused(call.replies):
                call.fill(call.replies)
            if not call.future.done():  # its caller may have been cancelled
                call.future.set_result(call.replies)

    def _late(self, future: asyncio.Future, timeout_s: float) -> None:
        if not future.done():
            self.fail(self.error(f"no reply within {timeout_s:g} s", ReplyLate))

    def error(self, why: str, kind: type[PipeError] = PipeError) -> PipeError:
        return kind(f"redis at {self.pipe.address.name()}: {why}")

    def fail(self, error: PipeError) -> None:
        """End the connection: its calls fail with `error` (the first), later calls open
        another."""
        if self.failed is None:
            self.failed = error
        if self.tracking and self.pipe.tracker is not None:
            self.tracking = False
            self.pipe.tracker.reset()
        self.pipe.forget(self)
        while self.waiting:
            call = self.waiting.popleft()
            call.timer.cancel()
            if not call.future.done():
                call.future.set_exception(self.failed)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(self.error(f"the connection was lost ({exc or 'closed by the server'})"))


class RedisPipe:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        address: PipeAddress,
        reply_timeout_s: float | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        """`reply_timeout_s`: None, REPLY_TIMEOUT_S. `tracker`: told what Redis invalidates of
        the reads of this pipe's connections (None: nothing is tracked)."""
        self.loop = loop
        self.address = address
        self.reply_timeout_s = REPLY_TIMEOUT_S if reply_timeout_s is None else reply_timeout_s
        self.tracker = tracker
        self._open: _Replies | None = None
        self._opening: asyncio.Future | None = None

    @property
    def tracking(self) -> bool:
        """Whether the open connection's reads are tracked (its tracker's values are fresh)."""
        return self._open is not None and self._open.tracking

    def drain(self) -> bool:
        """Take what the open connection's socket holds now (invalidations, replies); True
        where it is open and tracked afterwards. On the loop; no wait."""
        connection = self._open
        return connection is not None and connection.drain() and connection.tracking

    async def call(self, commands: Sequence[tuple | bytes], fill: Fill | None = None) -> list:
        """The replies of `commands` (each its words, or bytes already in RESP: pack_mget),
        sent as one write. PipeError where the connection fails or a reply is late;
        ReplyError where Redis refuses a command. `fill`: given the replies as they are read,
        where the connection is tracked and none is an error."""
        packed = b"".join(c if isinstance(c, bytes) else hiredis.pack_command(c) for c in commands)
        replies = await self._send(packed, len(commands), fill)
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise ReplyError(f"redis at {self.address.name()}: {reply}", str(reply))
        return replies

    async def _send(self, packed: bytes, count: int, fill: Fill | None = None) -> list:
        connection = self._open
        if connection is None:
            connection = await self._connect()
        return await connection.send(packed, count, self.reply_timeout_s, fill)

    async def _connect(self) -> _Replies:
        """The connection, opened once for every caller waiting on it."""
        if self._opening is None:
            self._opening = self.loop.create_task(self._opened())
        try:
            return await asyncio.shield(self._opening)
        finally:
            if self._opening is not None and self._opening.done():
                self._opening = None

    async def _opened(self) -> _Replies:
        connection = await self._connected()
        if self.tracker is not None:
            if await self._tracked(connection):
                self.tracker.reset()  # what was read on an earlier connection is not tracked
                connection.tracking = True
            else:  # refused: read untracked from now on (on a new connection: RESP2)
                self.tracker = None
                connection.fail(connection.error("refused tracking"))
                connection = await self._connected()
        handshake = self.address.handshake(authenticated=connection.tracking)
        if handshake:
            replies = await self._handshake(connection, handshake)
            if _refused(replies):
                refused = next(r for r in replies if isinstance(r, hiredis.ReplyError))
                connection.fail(connection.error(f"refused the connection: {refused}"))
                raise connection.failed
        self._open = connection
        return connection

    async def _connected(self) -> _Replies:
        """A new connection, its socket kept for `drain`."""
        address, loop = self.address, self.loop
        sock = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                targets = [(socket.AF_UNIX, address.path)]
                if not address.path:
                    infos = await loop.getaddrinfo(
                        address.host, address.port, type=socket.SOCK_STREAM
                    )
                    targets = [(family, target) for family, _, _, _, target in infos]
                for i, (family, target) in enumerate(targets):
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, target)
                        break
                    except OSError:
                        sock.close()
                        if i == len(targets) - 1:
                            raise
                if address.path:
                    _, connection = await loop.create_unix_connection(
                        lambda: _Replies(self, sock), sock=sock
                    )
                else:
                    _, connection = await loop.create_connection(
                        lambda: _Replies(self, sock), sock=sock
                    )
        except (OSError, TimeoutError) as exc:
            if sock is not None:
                sock.close()
            raise PipeError(f"redis at {address.name()} is unavailable: {exc!r}") from None
        return connection

    async def _tracked(self, connection: _Replies) -> bool:
        """RESP3 (as whom the address says) and CLIENT TRACKING ON; False where refused."""
        hello: tuple = (b"HELLO", b"3")
        if self.address.password is not None:
            hello += (b"AUTH", self.address.username or b"default", self.address.password)
        replies = await self._handshake(connection, [hello, (b"CLIENT", b"TRACKING", b"ON")])
        return not _refused(replies)

    async def _handshake(self, connection: _Replies, commands: list[tuple]) -> list:
        packed = b"".join(map(hiredis.pack_command, commands))
        return await connection.send(packed, len(commands), self.reply_timeout_s)

    def forget(self, connection: _Replies) -> None:
        if self._open is connection:
            self._open = None

    def close(self) -> None:
        """Abort the connection (on the loop); a later call opens another."""
        if self._open is not None:
            self._open.fail(self._open.error("the pipe was closed"))


def _refused(replies: list) -> bool:
    return any(isinstance(reply, hiredis.ReplyError) for reply in replies)
