"""The client's side of LookupStream: open calls reused across lookups, their deadlines kept.

Runs in the process of a MetadataClient (node agents, routers, the bench), in the threads that
look up plus one watchdog thread while any call is open. A lookup takes an idle open call (or
opens one, up to MAX_OPEN per client), sends its request and reads its answer in the asking
thread; the watchdog cancels a call whose answer is past its deadline (a stream message has no
deadline of its own) and closes calls idle for CLIENT_IDLE_S, before the service would end them.
Where no call is free (all in use, and no new one may be opened: MAX_OPEN are, the service has
no LookupStream, or it refused this client a slot in the last REFUSED_BACKOFF_S), `lookup`
returns None and the caller makes a unary Lookup instead, with what is left of the deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import grpc

from kvstore import errors
from kvstore.metadata.status import REFUSED_A_SLOT, error_for, lookup_answer
from kvstore.v1 import metadata_pb2 as pb

MAX_OPEN = 4  # calls per client; more lookups at once than this go unary
WATCH_PERIOD_S = 0.05  # how late past its deadline a lookup may be cancelled
CLIENT_IDLE_S = 30.0  # the service ends calls idle for 60 s (ServiceLimits.lookup_stream_idle_s)
REFUSED_BACKOFF_S = 10.0  # no new call, this long after the service refused one a slot
_END = object()
# failures of a call that had answered before: it may have ended while idle; ask on a new one
_ENDED_WHILE_IDLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, None)


class _Call:
    """One open LookupStream call, used by one thread at a time. gRPC's own thread sends the
    requests put in its queue; the answers are read by the asking thread."""

    def __init__(self, stub, metadata: tuple) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.LookupStream(self._outgoing(), metadata=metadata)
        self.deadline = 0.0  # monotonic time the answer in flight is due by; 0: none
        self.expired = False  # the watchdog cancelled it past its deadline
        self.answered = 0
        self.used_at = time.monotonic()

    def _outgoing(self):
        while (request := self._requests.get()) is not _END:
            yield request

    def ask(self, request: pb.LookupRequest, deadline: float) -> pb.LookupStreamResponse:
        self.deadline = deadline
        self._requests.put(request)
        try:
            answer = next(self.call)
        finally:
            self.deadline = 0.0
            self.used_at = time.monotonic()
        self.answered += 1
        return answer

    def close(self) -> None:
        self._requests.put(_END)  # frees gRPC's sending thread
        self.call.cancel()


class LookupCalls:
    def __init__(self, stub, metadata: Callable[[], tuple], enabled: bool = True) -> None:
        """`metadata`: of each new call (its token may change; client.call_metadata)."""
        self._stub = stub
        self._metadata = metadata
        self._lock = threading.Lock()
        self._idle: list[_Call] = []
        self._busy: set[_Call] = set()
        # monotonic; float("inf"): the service has no LookupStream, or the client wants none
        self._unary_until = 0.0 if enabled else float("inf")
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def lookup(self, request: pb.LookupRequest, deadline: float) -> pb.LookupResponse | None:
        """The service's answer on an open call, due by `deadline` (monotonic) over every
        attempt; None: make a unary call instead, with the time left. A refused request raises
        its error, as a unary call's would."""
        for _ in range(2):
            if self._closed:
                raise errors.UnavailableError("UNAVAILABLE: the metadata client is closed")
            if time.monotonic() >= deadline:
                raise errors.UnavailableError("DEADLINE_EXCEEDED: the lookup's time ran out")
            call = self._take()
            if call is None:
                return None
            try:
                answer = call.ask(request, deadline)
            except (grpc.RpcError, StopIteration) as exc:
                self._drop(call)
                self._raise_unless_retried(call, exc)
                continue
            except BaseException:  # an interrupted wait: the call's state is unknown
                self._drop(call)
                raise
            self._give(call)
            return lookup_answer(answer)
        return None

    def _raise_unless_retried(self, call: _Call, exc: BaseException) -> None:
        """After a call failed: returns where the lookup may be asked again (another call, or
        unary): a call that had answered before and may have ended while idle, a service
        without LookupStream, a call refused a slot; else raises the lookup's error."""
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        if call.expired:
            raise errors.UnavailableError("DEADLINE_EXCEEDED: no lookup answer by its deadline")
        if self._closed:
            raise errors.UnavailableError("UNAVAILABLE: the metadata client is closed")
        if call.answered and code in _ENDED_WHILE_IDLE:
            return
        if not call.answered and code == grpc.StatusCode.UNIMPLEMENTED:
            self._unary_until = float("inf")
            return
        if not call.answered and _refused_a_slot(exc):
            self._unary_until = time.monotonic() + REFUSED_BACKOFF_S
            return
        raise _error(code, exc)

    def _take(self) -> _Call | None:
        """An idle open call, or a new one unless MAX_OPEN are open or calls may not be
        opened now (after a refusal; without LookupStream); None: none to be had."""
        with self._lock:
            if self._closed:
                return None
            if self._idle:
                call = self._idle.pop()
            elif len(self._busy) < MAX_OPEN and time.monotonic() >= self._unary_until:
                call = _Call(self._stub, self._metadata())
            else:
                return None
            self._busy.add(call)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="lookup-calls", daemon=True
                )
                self._watchdog.start()
            return call

    def _give(self, call: _Call) -> None:
        with self._lock:
            self._busy.discard(call)
            if self._closed or call.expired:
                call.close()
            else:
                self._idle.append(call)

    def _drop(self, call: _Call) -> None:
        with self._lock:
            self._busy.discard(call)
        call.close()

    def _watch(self) -> None:
        """Cancels calls past their answer's deadline, closes idle ones; ends with the last."""
        while True:
            time.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            with self._lock:
                late = [c for c in self._busy if c.deadline and now > c.deadline]
                for call in late:
                    call.expired = True
                stale = [c for c in self._idle if now - c.used_at > CLIENT_IDLE_S]
                self._idle = [c for c in self._idle if c not in stale]
                if not self._busy and not self._idle:
                    self._watchdog = None
                    ending = True
                else:
                    ending = False
            for call in late + stale:
                call.close()
            if ending:
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls, self._idle = self._idle + list(self._busy), []
        for call in calls:
            call.close()


def _refused_a_slot(exc: BaseException) -> bool:
    """The service refused the call a slot (it says so in the trailing metadata: an oversized
    message is RESOURCE_EXHAUSTED too, and no reason to stop opening calls)."""
    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    return REFUSED_A_SLOT in tuple(exc.trailing_metadata() or ())


def _error(code: grpc.StatusCode | None, exc: BaseException) -> errors.KVStoreError:
    if code is None:
        return errors.UnavailableError("UNAVAILABLE: the service ended the LookupStream")
    return error_for(code, exc.details())
