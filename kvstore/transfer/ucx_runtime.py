"""The process's one UCX context for the `ucx` transfer engine: the event-loop thread that
drives it, the threads that open blocks, and the reference count of the engines using it.

Runs inside the node agent. ucxx is asyncio-based and progresses one context per event loop,
so every UcxEngine of a process shares this runtime; it stops with the last engine, or at exit
while the interpreter is whole (UCX's threads call back into Python).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import gc
import logging
import os
import socket
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.transfer.ucx import UcxEngine

logger = logging.getLogger(__name__)

# UCX reads these when its libraries load (the first `import ucxx`, which must come after this
# module's import); values already set win.
if "ucxx" in sys.modules:
    logger.warning("ucxx was imported before %s: UCX may print warnings on stdout", __name__)
for _name, _value in {
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # else UCX lists every unused UCX_* variable
    "UCX_LOG_FILE": "stderr",  # UCX and UCXX log to stdout by default
    "UCXX_LOG_LEVEL": "FATAL",  # UCXX logs every peer that disconnects as an ERROR
}.items():
    os.environ.setdefault(_name, _value)

START_TIMEOUT_S = 30.0


class Runtime:
    """The process's UCX context, the event-loop thread that drives it, and the threads that
    open blocks (a store may block; the loop must not)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.users: set[UcxEngine] = set()  # strong references: a serving engine lives on
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvstore-ucx")
        self.thread.daemon = True
        self.readers = concurrent.futures.ThreadPoolExecutor(8, "kvstore-ucx-open")
        self.context: Any = None
        self.address = b""  # the worker's UCX address, which peers make endpoints from
        self._progress: Any = None

    def start(self) -> None:
        self.thread.start()
        self.call(self._make_context(), START_TIMEOUT_S)

    async def _make_context(self) -> None:
        # On the loop thread: ucxx binds its progress and notifier to the running loop. Python
        # futures complete requests without spinning the loop (ucxx polls with sleep(0) else).
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.application_context import ProgressTasks

        self.context = ApplicationContext(
            self.options, progress_mode="thread", enable_python_future=True
        )
        # ucxx keeps progress threads in a module-wide dict that any dying context clears
        # (stopping the threads in it): our own reference keeps ours running.
        self._progress = ProgressTasks[self.loop]
        self.address = self.context.worker_address.tobytes()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        return self.submit(coro).result(timeout_s)

    def stop(self) -> None:
        """Cancel leftover tasks, stop UCX's threads, then the loop. Endpoints must be closed."""
        from ucxx._lib_async.application_context import ProgressTasks

        self.call(_cancel_other_tasks(), START_TIMEOUT_S)
        context, self.context = self.context, None
        context.worker.stop_request_notifier_thread()  # wakes the notifier now, not in 1 s
        context.stop_notifier_thread()
        context.worker.stop_progress_thread()
        ProgressTasks.pop(self.loop, None)
        self._progress = context = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        self.readers.shutdown(wait=False, cancel_futures=True)
        gc.collect()  # the context dies now, while no other runtime's progress can be cleared


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def net_devices_for(host: str) -> str | None:
    """UCX_NET_DEVICES for a listener on `host`: the network interface that owns it and every
    RDMA port (no IP sockets), so UCX's tcp transport listens on that interface only. None for
    a wildcard host; ConfigError if no interface has the address."""
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
    except OSError as exc:
        raise ConfigError(f"ucx engine cannot resolve its host {host!r}: {exc}") from exc
    owners = [
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(address.address.split("%")[0] in wanted for address in addresses)
    ]
    if not owners:
        raise ConfigError(f"no network interface has {host!r}; pass net_devices explicitly")
    rdma = sorted(
        f"{port.parent.parent.name}:{port.name}"
        for port in Path("/sys/class/infiniband").glob("*/ports/*")
    )
    return ",".join([owners[0], *rdma])


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def acquire_runtime(engine: UcxEngine, options: dict[str, str]) -> Runtime:
    """The shared runtime, started on first use. UCX options are per process: all must agree."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            runtime = Runtime(options)
            runtime.start()
            _runtime = runtime
        elif any(_runtime.options.get(name) != value for name, value in options.items()):
            raise ConfigError(
                f"UCX already runs in this process with {_runtime.options}; all ucx engines "
                f"of a process must agree on tls and net_devices, not {options}"
            )
        _runtime.users.add(engine)
        return _runtime


def release_runtime(engine: UcxEngine, runtime: Runtime) -> None:
    global _runtime
    with _runtime_lock:
        runtime.users.discard(engine)
        if runtime.users or runtime is not _runtime:
            return
        _runtime = None
        runtime.stop()


def _stop_at_exit() -> None:
    """Stop UCX while the interpreter is whole: UCX's threads call back into Python."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
        if runtime is not None:
            runtime.stop()


atexit.register(_stop_at_exit)
