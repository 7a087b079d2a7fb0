"""LayerwiseLoad and PooledLoad, the worker's layer-by-layer copy schedules (inline, in the
background, and pooled between a helper and the forward's thread): a layer is copied before
anyone who waits for it returns, each chunk's layers in order, each copy exactly once; a copy
that fails releases every waiter and is reported (the worker turns it into load errors)."""

import os
import threading
import time

import pytest

from kvstore.connectors.vllm import layerwise
from kvstore.connectors.vllm.layerwise import LayerwiseLoad, PooledLoad

NAMES = [f"layer{i}" for i in range(4)]


def recording_load(background: bool, fail_at: int | None = None):
    copied: list[int] = []
    threads: set[str] = set()

    def copy_layer(index: int) -> None:
        if index == fail_at:
            raise RuntimeError("page gone")
        copied.append(index)
        threads.add(threading.current_thread().name)

    return LayerwiseLoad(NAMES, copy_layer, background=background), copied, threads


def test_inline_loads_copy_on_the_forwards_thread_only_as_far_as_it_waited():
    load, copied, threads = recording_load(background=False)
    load.wait("layer1")
    assert copied == [0, 1]
    load.wait("layer1")
    load.wait("not-a-kv-layer")
    assert copied == [0, 1]
    load.join()
    assert copied == [0, 1, 2, 3] and threads == {threading.current_thread().name}


def test_background_loads_copy_every_layer_in_order_on_their_thread():
    load, copied, threads = recording_load(background=True)
    load.wait("layer3")
    assert copied == [0, 1, 2, 3]
    load.join()
    assert copied == [0, 1, 2, 3] and threads == {"kvstore-load"}


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_copy_releases_every_waiter_and_is_reported(background):
    load, copied, _ = recording_load(background, fail_at=1)
    load.wait("layer3")  # must not hang
    load.join()
    assert copied == [0] and isinstance(load.error, RuntimeError)


UNITS = 3


def pooled_load(copy_unit=None, cpus=None):
    """A PooledLoad of NAMES x UNITS recording (layer, unit, helper, thread's cores)."""
    copied: list[tuple[int, int, bool, frozenset]] = []

    def record(layer: int, unit: int, helper: bool) -> None:
        if copy_unit is not None:
            copy_unit(layer, unit, helper)
        copied.append((layer, unit, helper, frozenset(os.sched_getaffinity(0))))

    cores = cpus or frozenset([min(os.sched_getaffinity(0))])
    return PooledLoad(NAMES, lambda: UNITS, record, cores), copied, cores


def test_a_pooled_load_copies_each_chunk_layer_once_and_a_waited_layer_before_returning():
    load, copied, _ = pooled_load()
    load.wait("layer2")
    assert {(layer, unit) for layer, unit, *_ in copied} >= {
        (layer, unit) for layer in range(3) for unit in range(UNITS)
    }
    load.join()
    assert sorted((layer, unit) for layer, unit, *_ in copied) == [
        (layer, unit) for layer in range(len(NAMES)) for unit in range(UNITS)
    ]
    assert load.error is None


def test_the_forward_copies_what_a_held_up_helper_has_not_claimed_and_the_helper_its_cores():
    forward_copied = threading.Event()

    def copy_unit(layer: int, unit: int, helper: bool) -> None:
        if helper and layer == 1:
            assert forward_copied.wait(timeout=10)  # held up until the forward helps
        elif not helper and layer == 1:
            forward_copied.set()

    load, copied, cores = pooled_load(copy_unit)
    for name in NAMES:
        load.wait(name)
    load.join()
    assert load.error is None
    forward = [layer for layer, _, helper, _ in copied if not helper]
    helped = [cpus for _, _, helper, cpus in copied if helper]
    assert 1 in forward, "the forward waited for a held-up helper instead of copying"
    assert set(helped) <= {cores} and load.helper_copies == len(helped)


def test_no_chunk_layer_starts_before_every_copy_of_the_layer_before_is_done():
    done_layers: list[int] = []
    lock = threading.Lock()
    starts: list[tuple[int, int]] = []  # (layer, layers fully done when it started)
    finished = {layer: 0 for layer in range(len(NAMES))}

    def copy_unit(layer: int, unit: int, helper: bool) -> None:
        with lock:
            starts.append((layer, len(done_layers)))
        time.sleep(0.001)
        with lock:
            finished[layer] += 1
            if finished[layer] == UNITS:
                done_layers.append(layer)

    load, _, _ = pooled_load(copy_unit)
    for name in NAMES:
        load.wait(name)
    load.join()
    assert done_layers == list(range(len(NAMES)))
    assert all(layers_done >= layer for layer, layers_done in starts)


@pytest.mark.parametrize("failing", ["helper", "forward"])
def test_a_failed_pooled_copy_releases_every_waiter_and_fails_the_load(failing):
    tried = threading.Event()  # the failing thread met its failure

    def copy_unit(layer: int, unit: int, helper: bool) -> None:
        if helper == (failing == "helper"):
            tried.set()
            raise RuntimeError("page gone")
        assert tried.wait(timeout=10)  # the other thread holds its unit until then

    load, _, _ = pooled_load(copy_unit)
    if failing == "helper":
        assert tried.wait(timeout=10)  # the helper claims first
    load.wait("layer3")  # must not hang
    load.join()
    assert isinstance(load.error, RuntimeError)


def test_the_load_is_prepared_once_before_any_copy_and_a_waiting_forward_waits_for_it():
    release = threading.Event()
    prepared_by: list[str] = []
    copies: list[int] = []

    def prepare() -> int:  # the step's fetch: the agent's answer, the plan
        prepared_by.append(threading.current_thread().name)
        assert release.wait(timeout=10)
        return UNITS

    def copy_unit(layer: int, unit: int, helper: bool) -> None:
        assert len(prepared_by) == 1 and release.is_set()
        copies.append(layer)

    load = PooledLoad(NAMES, prepare, copy_unit, frozenset([min(os.sched_getaffinity(0))]))
    waiter = threading.Thread(target=load.wait, args=("layer0",), name="forward")
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # the forward's wait holds until the load is prepared
    release.set()
    waiter.join(timeout=10)
    load.join()
    assert len(prepared_by) == 1 and prepared_by[0] in {"kvstore-load-helper", "forward"}
    assert len(copies) == len(NAMES) * UNITS and load.error is None


def test_a_forward_that_finds_the_helper_not_started_prepares_and_copies_itself(monkeypatch):
    """The helper's core is busy elsewhere (here: its binding never returns in time): the
    forward's thread prepares the load and copies what it needs; nothing waits on the helper."""
    helper_may_start = threading.Event()
    monkeypatch.setattr(layerwise, "bind_this_thread", lambda cpus: helper_may_start.wait(10))
    prepared_by: list[str] = []

    def prepare() -> int:
        prepared_by.append(threading.current_thread().name)
        return UNITS

    copied: list[bool] = []
    load = PooledLoad(
        NAMES, prepare, lambda layer, unit, helper: copied.append(helper), frozenset([0])
    )
    load.wait("layer3")  # returns with the helper still held at its start
    assert prepared_by == [threading.current_thread().name]
    assert copied == [False] * (len(NAMES) * UNITS)
    helper_may_start.set()
    load.join()
    assert load.error is None and load.helper_copies == 0


def test_a_failed_preparation_releases_every_waiter_and_fails_the_load():
    def prepare() -> int:
        raise RuntimeError("agent gone")

    def copy_unit(layer: int, unit: int, helper: bool) -> None:
        raise AssertionError("nothing is copied of a load that was never prepared")

    load = PooledLoad(NAMES, prepare, copy_unit, frozenset([min(os.sched_getaffinity(0))]))
    load.wait("layer3")  # must not hang
    load.join()
    assert isinstance(load.error, RuntimeError)
