"""kvstore.stop_signals: a SIGTERM that lands at any step of a service's wait ends it. The first
handler set a threading.Event; a SIGTERM arriving while the wait held that Event's lock
deadlocked the process for good (one CI run's `kvstore serve` never exited). Each wait runs
in a child process, a SIGTERM sent at its n-th profiled step, for every n."""

import subprocess
import sys

STEPS = 100  # the wait takes about 80 steps before it blocks; the old one deadlocked at 51

SIGNAL_AT_EVERY_STEP = r"""
import os, signal, sys, threading
from kvstore.stop_signals import StopSignals

signal.signal(signal.SIGTERM, lambda *_: None)  # a signal before the wait's own handlers


def wait_with_a_signal_at(step):
    seen = 0

    def count(frame, event, arg):
        nonlocal seen
        seen += 1
        if seen == step:
            os.kill(os.getpid(), signal.SIGTERM)

    late = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))  # past its steps
    late.start()
    sys.setprofile(count)
    try:
        with StopSignals() as stop:
            stop.wait()
    finally:
        sys.setprofile(None)
        late.cancel()


for step in range(1, int(sys.argv[1]) + 1):
    wait_with_a_signal_at(step)
print("every wait ended")
"""


def test_a_stop_signal_at_any_step_of_the_wait_ends_it():
    try:
        done = subprocess.run(
            [sys.executable, "-c", SIGNAL_AT_EVERY_STEP, str(STEPS)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("a SIGTERM during the wait deadlocked it") from None
    assert done.returncode == 0 and "every wait ended" in done.stdout, done.stderr


def test_a_wait_times_out_and_other_signals_do_not_end_it():
    script = r"""
import os, signal, threading, time
from kvstore.stop_signals import StopSignals
signal.signal(signal.SIGUSR1, lambda *_: None)  # a handled signal writes the wakeup socket
with StopSignals() as stop:
    assert stop.wait(0.05) is False and not stop.is_set()
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    assert stop.wait(5) is True and stop.is_set() and stop.wait(0) is True
    print(round(time.monotonic() - started, 1))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) >= 0.5, "SIGUSR1 ended the wait"
