"""A step's layer-wise loads: which thread copies which layer when, so that the attention of
layer i waits only for layer i. Runs in each vLLM worker process (the connector's worker half,
worker.py).

The step's copies are split into shares, each copied layer after layer by one thread:
- the forward's share, on its own thread as each layer's attention first waits for it (the
  CPU: the forward's cores would otherwise idle in that wait), or on a background thread
  ahead of the forward (CUDA: it only submits copies and hashes, so the forward keeps going);
- on the CPU, where vLLM bound its OpenMP team to some of the process's cores and left others
  free (VLLM_CPU_NUM_OF_RESERVED_CPU: the engine's other processes and, by vLLM's own rule, a
  KV connector's transfers: kvstore/cores.py), a helper's share, on a thread bound to those
  free cores. A load is memory-bound: two cores copy a step's chunks in ~0.7-0.85 of the
  time one takes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvstore.cores import bind_this_thread

logger = logging.getLogger(__name__)

CopyLayer = Callable[[int], None]


class _Share:
    """One thread's part of a step's copies: its layers in order, an event per layer."""

    def __init__(self, layers: int, copy_layer: CopyLayer) -> None:
        self.done = [threading.Event() for _ in range(layers)]
        self.error: BaseException | None = None
        self._copy_layer = copy_layer
        self._next = 0  # the first layer not copied yet

    def run(self, stop: int | None = None) -> None:
        """Copy the layers before `stop` (all: None) not copied yet."""
        stop = len(self.done) if stop is None else stop
        try:
            while self._next < stop:
                self._copy_layer(self._next)
                self.done[self._next].set()
                self._next += 1
        except BaseException as exc:  # reported as load errors; never leave a waiter hanging
            self.error = exc
            logger.exception("layer-wise load failed")
            for event in self.done:
                event.set()
            self._next = len(self.done)


class LayerwiseLoad:
    """One step's loads, layer after layer: `wait(layer)` returns once that layer (and every
    earlier one) is copied by every share. `copy_layer` is the forward's share: copied inline
    by the forward's thread when it first waits for a layer, or with `background` by a thread
    of its own; each of `helpers` is copied by a thread bound to `cpus` (None: unbound)."""

    def __init__(
        self,
        names: Sequence[str],
        copy_layer: CopyLayer,
        background: bool,
        helpers: Sequence[CopyLayer] = (),
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self._own = _Share(len(names), copy_layer)
        self._shares = [self._own, *(_Share(len(names), helper) for helper in helpers)]
        self._inline = not background
        self._threads = [] if self._inline else [_start(self._own, None, "kvstore-load")]
        self._threads += [_start(share, cpus, "kvstore-load-helper") for share in self._shares[1:]]

    @property
    def error(self) -> BaseException | None:
        """The first share's failure, if any share failed (the whole load is then an error)."""
        return next((share.error for share in self._shares if share.error), None)

    def wait(self, layer_name: str) -> None:
        index = self.index.get(layer_name)
        if index is None:
            return
        if self._inline:
            self._own.run(stop=index + 1)
        for share in self._shares:
            share.done[index].wait()

    def join(self) -> None:
        """Every layer copied (inline: the ones the forward did not wait for, now)."""
        if self._inline:
            self._own.run()
        for thread in self._threads:
            thread.join()


def _start(share: _Share, cpus: frozenset[int] | None, name: str) -> threading.Thread:
    thread = threading.Thread(target=_bound, args=(share, cpus), name=name, daemon=True)
    thread.start()
    return thread


def _bound(share: _Share, cpus: frozenset[int] | None) -> None:
    """On a share's thread: bind it to `cpus` (it inherits the forward's binding), then copy."""
    if cpus:
        bind_this_thread(cpus)
    share.run()
