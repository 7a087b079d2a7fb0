"""LayerwiseLoad, the worker's layer-by-layer copy schedule, in both of its modes and with a
helper's share: a layer is copied before anyone who waits for it returns, in layer order,
each exactly once; a copy that fails releases every waiter and is reported (the worker turns
it into load errors)."""

import os
import threading

import pytest

from kvstore.connectors.vllm.layerwise import LayerwiseLoad

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


def test_a_helpers_share_is_copied_on_its_own_thread_bound_to_its_cores():
    own, helped = [], []
    helper_cores = []

    def copy_helped(index: int) -> None:
        helper_cores.append(os.sched_getaffinity(0))
        helped.append(index)

    cores = frozenset([min(os.sched_getaffinity(0))])
    load = LayerwiseLoad(NAMES, own.append, background=False, helpers=[copy_helped], cpus=cores)
    load.wait("layer2")  # both shares have copied layers 0..2 when it returns
    assert own == [0, 1, 2] and helped[:3] == [0, 1, 2]
    load.join()
    assert own == helped == [0, 1, 2, 3] and load.error is None
    assert set(map(frozenset, helper_cores)) == {cores}


def test_a_failed_helper_releases_every_waiter_and_fails_the_load():
    def copy_helped(index: int) -> None:
        if index == 1:
            raise RuntimeError("page gone")

    load = LayerwiseLoad(NAMES, lambda index: None, background=False, helpers=[copy_helped])
    load.wait("layer3")  # must not hang
    load.join()
    assert isinstance(load.error, RuntimeError)
