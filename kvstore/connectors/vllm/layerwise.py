"""A step's layer-wise loads: which thread copies which layer when, so that the attention of
layer i waits only for layer i. Runs in each vLLM worker process (the connector's worker half,
worker.py).

Two schedules:
- `LayerwiseLoad`: the step's copies of a layer are copied by one thread, layer after layer:
  on the forward's own thread as each layer's attention first waits for it (the CPU: the
  forward's cores would otherwise idle in that wait), or on a background thread ahead of the
  forward (CUDA: it only submits copies and hashes, so the forward keeps going).
- `PooledLoad`, on the CPU where vLLM bound its OpenMP team to some of the process's cores and
  left others free (VLLM_CPU_NUM_OF_RESERVED_CPU: the engine's other processes and, by vLLM's
  own rule, a KV connector's transfers: kvstore/cores.py): a helper thread bound to those free
  cores takes the agent's answer to the step's load (the pins: sent as the step starts), then
  copies every layer, ahead of the forward, one chunk layer at a time; the forward's thread,
  when a layer's attention waits for it, copies that layer's chunks the helper has not
  reached yet, then waits for the helper's. The helper starts while the forward still runs
  everything before the first attention, and copies a layer in about the time the forward
  computes one, so the forward mostly finds its layers copied and waits for no round trip.

A chunk's digest runs over its layers in order (worker.py), so no schedule copies layer i + 1
of a chunk before its layer i.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence

from kvstore.cores import bind_this_thread

logger = logging.getLogger(__name__)

CopyLayer = Callable[[int], None]
CopyUnit = Callable[[int, int, bool], None]  # (layer, unit, on the helper's thread)


class _Share:
    """A step's copies, layer after layer by one thread at a time, an event per layer."""

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
    earlier one) is copied. `copy_layer` copies one layer of every chunk: inline by the
    forward's thread when it first waits for a layer, or with `background` by a thread of its
    own."""

    def __init__(self, names: Sequence[str], copy_layer: CopyLayer, background: bool) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self._share = _Share(len(names), copy_layer)
        self._inline = not background
        self._thread = None if self._inline else _start(self._share.run, "kvstore-load")

    @property
    def error(self) -> BaseException | None:
        """The copy's failure, if any (the whole load is then an error)."""
        return self._share.error

    def wait(self, layer_name: str) -> None:
        index = self.index.get(layer_name)
        if index is None:
            return
        if self._inline:
            self._share.run(stop=index + 1)
        self._share.done[index].wait()

    def join(self) -> None:
        """Every layer copied (inline: the ones the forward did not wait for, now)."""
        if self._inline:
            self._share.run()
        if self._thread is not None:
            self._thread.join()


class _Layer:
    """One layer's copies (units), each claimed by whichever thread asks first."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.done = threading.Event()  # every unit copied (or the load failed)
        self._claims = itertools.count()  # next() is atomic: one claimant per unit
        self._left = units
        self._lock = threading.Lock()
        if not units:
            self.done.set()

    def claim(self) -> int | None:
        unit = next(self._claims)
        return unit if unit < self.units else None

    def finish(self) -> None:
        with self._lock:
            self._left -= 1
            if not self._left:
                self.done.set()


class PooledLoad:
    """One step's loads on the CPU with a helper. `prepare` (the step's fetch: how many chunk
    layers, `units`, each layer has) runs once, on whichever thread gets to it first: the
    helper, bound to `cpus`, as it starts (the forward meanwhile runs what comes before its
    first attention), or the forward's, when that attention finds the helper not started yet
    (its core busy elsewhere). Then the helper copies every layer by `copy_unit(layer, unit,
    helper)`, and the forward's thread copies in `wait` what the helper has not claimed yet.
    `wait(layer)` returns once that layer (and every earlier one) is copied, or the load
    failed (`error`)."""

    def __init__(
        self,
        names: Sequence[str],
        prepare: Callable[[], int],
        copy_unit: CopyUnit,
        cpus: frozenset[int],
    ) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.error: BaseException | None = None
        self.helper_copies = 0  # units the helper copied
        self._layers: list[_Layer] = []
        self._prepare = prepare
        self._prepare_claims = itertools.count()  # the first to draw 0 prepares
        self._ready = threading.Event()  # prepared (the layers are known), or failed
        self._copy_unit = copy_unit
        self._waited = 0  # layers [0, _waited) are copied and waited for by the forward
        self._thread = _start(lambda: self._help(cpus), "kvstore-load-helper")

    def wait(self, layer_name: str) -> None:
        index = self.index.get(layer_name)
        if index is not None:
            self._copy_until(index + 1)

    def join(self) -> None:
        """Every layer copied (by the forward's thread, what the helper did not reach)."""
        self._copy_until(len(self.index))
        self._thread.join()

    def _copy_until(self, stop: int) -> None:
        """On the forward's thread: layers [_waited, stop) copied, in order, helping each."""
        self._prepared()
        while self._waited < min(stop, len(self._layers)):
            layer = self._layers[self._waited]
            self._copy_claimed(self._waited, helper=False)
            layer.done.wait()
            self._waited += 1

    def _prepared(self) -> None:
        """Prepare, unless another thread did or does (then wait for it)."""
        if next(self._prepare_claims) == 0:
            try:
                units = self._prepare()
            except BaseException as exc:  # reported as load errors; never leave a waiter
                self._fail(exc)
                return
            self._layers = [_Layer(units) for _ in self.index]
            self._ready.set()
        self._ready.wait()

    def _help(self, cpus: frozenset[int]) -> None:
        """The helper's thread: prepared, then every layer in order, each begun once the one
        before is done (a chunk's digest takes its layers in order)."""
        bind_this_thread(cpus)
        self._prepared()
        for index in range(len(self._layers)):
            if index:
                self._layers[index - 1].done.wait()
            if self.error is not None:
                return
            self.helper_copies += self._copy_claimed(index, helper=True)

    def _copy_claimed(self, index: int, helper: bool) -> int:
        """Copy the units of layer `index` nobody has claimed yet; how many this thread did."""
        layer, copied = self._layers[index], 0
        while self.error is None and (unit := layer.claim()) is not None:
            try:
                self._copy_unit(index, unit, helper)
            except BaseException as exc:  # reported as load errors; never leave a waiter
                self._fail(exc)
                break
            layer.finish()
            copied += 1
        return copied

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            logger.error("layer-wise load failed", exc_info=exc)
        for layer in self._layers:
            layer.done.set()
        self._ready.set()


def _start(run: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
