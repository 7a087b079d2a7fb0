"""LayerwiseLoad, the worker's layer-by-layer copy schedule, in both of its modes: a layer is
copied before anyone who waits for it returns, in layer order, each exactly once; a copy that
fails releases every waiter and is reported (the worker turns it into load errors)."""

import threading

import pytest

from kvstore.connectors.vllm.worker import LayerwiseLoad

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
