"""LookupStream: lookups as messages on one long-lived bidirectional call, served on the loop.

Runs in the metadata service process, on the gRPC asyncio loop. A unary Lookup pays gRPC's
per-call work (a new HTTP/2 stream, its metadata, in grpc.aio three tasks and a dozen loop
callbacks); a message on an open call pays a fraction of it, so on loopback a lookup costs about
half the time and a client process a fraction of the CPU (`kvstore bench lookup`:
`grpc_stream_echo_64_p50_us` beside `grpc_echo_64_p50_us`). The call is authorised once, at
its start; each request is answered in order, a bad one with its status in the answer, and the
call stays open. Open calls hold slots of their caller's scope (StreamSlots), and a call with no
request for `idle_s` is ended with UNAVAILABLE (its client opens another at its next lookup).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from kvstore.metadata.server.auth import TenantScope
from kvstore.metadata.server.lookup_access import LookupAccess
from kvstore.metadata.server.slots import StreamSlots

logger = logging.getLogger(__name__)

ANSWERING = float("inf")  # the idle clock of a call whose request is being answered


class LookupStreams:
    def __init__(self, access: LookupAccess, count_call: Callable[[grpc.StatusCode], None]) -> None:
        """`count_call`: counts a call's opening by its status."""
        self.access = access
        self.count_call = count_call
        self._last_request: dict[asyncio.Task, tuple[float, grpc.aio.ServicerContext]] = {}
        self._sweep_handle: asyncio.TimerHandle | None = None

    @property
    def slots(self) -> StreamSlots:
        return self.access.slots

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep_handle = loop.call_later(self.access.idle_s / 4, self._sweep, loop)

    def stop(self) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        """The call's handler (an async generator: one answer per request, in order)."""
        opened = functools.partial(self._authorized, context)
        scope, _ = await self.slots.admit(context, opened, self.count_call)
        self.count_call(grpc.StatusCode.OK)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        self._last_request[task] = (loop.time(), context)
        try:
            async for payload in requests:
                self._last_request[task] = (ANSWERING, context)  # not idle, however long
                if self.access.answer_later is None:
                    answer = self.access.answer(payload, scope)
                elif (answer := self.access.answer_ready(payload, scope)) is None:
                    answer = await self.access.answer_later(payload, scope)
                self._last_request[task] = (loop.time(), context)  # idle from here
                yield answer
        finally:
            self._last_request.pop(task, None)  # the sweep may have taken it
            self.slots.release(scope.tenant)

    async def _authorized(self, context: grpc.aio.ServicerContext) -> tuple[TenantScope, None]:
        return await self.access.auth.authorize(context), None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Ends the calls idle for longer than `idle_s` (on the loop, every quarter of it)."""
        now, idle_s = loop.time(), self.access.idle_s
        for task, (last, context) in list(self._last_request.items()):
            if last != ANSWERING and now - last > idle_s:
                del self._last_request[task]  # ended once, even if the next sweep comes first
                loop.create_task(self._end(task, context))
        self._sweep_handle = loop.call_later(idle_s / 4, self._sweep, loop)

    async def _end(self, task: asyncio.Task, context: grpc.aio.ServicerContext) -> None:
        """Sends the call's status from outside its handler (cancelling the handler's task
        alone sends none: the client would wait for good), then stops the handler."""
        message = f"LookupStream idle for over {self.access.idle_s:g} s; open another"
        with contextlib.suppress(Exception):  # AbortError, or the call ended meanwhile
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        task.cancel()
