"""`daemon.SignalFlag`: the lock-free wait that `pdserve up` (SIGINT/SIGTERM) and
`status --watch` (Ctrl-C) use. A handler that called `threading.Event.set` could run while the
main thread holds that event's lock and deadlock the process (the last test shows it in a child
process); this one only assigns, so a signal storm during waits always ends them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from deploy.cli.daemon import SignalFlag


def send_later(signum: int, delay_s: float, times: int = 1) -> threading.Thread:
    def send() -> None:
        for _ in range(times):
            time.sleep(delay_s)
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_signal_ends_the_wait_early_and_the_old_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with SignalFlag(signal.SIGUSR1) as flag:
        assert signal.getsignal(signal.SIGUSR1) != before
        sender = send_later(signal.SIGUSR1, 0.1)
        started = time.monotonic()
        assert flag.wait(30.0) is True
        assert time.monotonic() - started < 5.0
        sender.join(5)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_without_a_signal_the_wait_lasts_its_time_and_says_so() -> None:
    with SignalFlag(signal.SIGUSR1) as flag:
        started = time.monotonic()
        assert flag.wait(0.2) is False
        assert time.monotonic() - started >= 0.2


def test_many_signals_during_many_short_waits_never_hang() -> None:
    """The pattern that deadlocked with an Event: signals landing at any point of a wait."""
    with SignalFlag(signal.SIGUSR1) as flag:
        sender = send_later(signal.SIGUSR1, 0.001, times=300)
        deadline = time.monotonic() + 20
        waits = 0
        while sender.is_alive() and time.monotonic() < deadline:
            flag.is_set = False
            flag.wait(0.002)
            waits += 1
        sender.join(5)
        assert not sender.is_alive() and waits > 0


EVENT_HANDLER = """
import os, signal, threading
stop = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: stop.set())
with stop._cond:  # where Event.wait/clear/is_set hold it
    os.kill(os.getpid(), signal.SIGUSR1)
print("not reached")
"""


def test_why_an_event_handler_is_not_used_it_deadlocks_on_its_own_lock() -> None:
    with subprocess.Popen([sys.executable, "-c", EVENT_HANDLER], stdout=subprocess.PIPE) as proc:
        try:
            proc.wait(timeout=3)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            proc.kill()
    assert hung, "an Event set from a signal handler no longer deadlocks: SignalFlag may go"
