"""The agent's demotion thread, with a stand-in store (this layer only; the real agent and disk
are in test_slow_disk.py): it keeps calling demote_ahead, and a failure is logged and retried
after a back-off, never a dead thread or a log line every poll."""

import logging
import threading
import time

from kvstore.node import demotion
from kvstore.node.demotion import DemotionThread, free_pages_target


class FailingStore:
    def __init__(self) -> None:
        self.calls = 0

    def demote_ahead(self, free_pages: int, stop=None) -> int:
        self.calls += 1
        raise RuntimeError("disk tier full: all pages are pinned")


def test_a_failing_demotion_backs_off_and_keeps_running(caplog):
    store = FailingStore()
    thread = DemotionThread(store, free_pages=2)
    with caplog.at_level(logging.ERROR, logger="kvstore.node.demotion"):
        thread.start()
        time.sleep(demotion.BACKOFF_S / 2)
        assert store.calls == 1 and thread.running
        started = time.perf_counter()
        thread.stop()
    assert time.perf_counter() - started < demotion.BACKOFF_S / 2, "stop cuts the back-off short"
    assert len(caplog.records) == 1 and "retrying" in caplog.records[0].getMessage()


def test_the_free_pages_target():
    assert free_pages_target(-1, 512) == 16  # 1/32 of the arena
    assert free_pages_target(-1, 16) == 0  # small arenas: off
    assert free_pages_target(4, 512) == 4 and free_pages_target(900, 512) == 256  # at most half


class HungDiskStore:
    """demote_ahead blocks in its disk write until `disk` is set (a hung disk)."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.disk = threading.Event()

    def demote_ahead(self, free_pages: int, stop=None) -> int:
        self.writing.set()
        self.disk.wait()
        return 1


def test_stop_gives_up_on_a_hung_disk_write_after_its_timeout(caplog):
    store = HungDiskStore()
    thread = DemotionThread(store, free_pages=2)
    thread.start()
    assert store.writing.wait(5)
    started = time.perf_counter()
    with caplog.at_level(logging.ERROR, logger="kvstore.node.demotion"):
        assert thread.stop(timeout_s=0.2) is False
    assert time.perf_counter() - started < 2
    assert "left open" in caplog.records[0].getMessage()
    store.disk.set()  # the write returns: the thread sees the stop and ends
    assert thread.stop(timeout_s=5) is True and not thread.running
