"""EarlyAborts: an abort that found no call is taken once by the call that comes within
`memory_s`, and forgotten after it."""

from __future__ import annotations

from worker_runtime.early_aborts import EarlyAborts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_early_aborts(memory_s: float = 60.0) -> tuple[EarlyAborts, Clock]:
    clock = Clock()
    return EarlyAborts(memory_s, clock), clock


def test_a_remembered_abort_is_taken_once() -> None:
    aborts, _ = make_early_aborts()
    aborts.remember("a")
    assert aborts.take("a") is True
    assert aborts.take("a") is False
    assert len(aborts) == 0


def test_an_id_never_aborted_is_not_taken() -> None:
    aborts, _ = make_early_aborts()
    aborts.remember("a")
    assert aborts.take("b") is False
    assert len(aborts) == 1


def test_an_abort_is_taken_until_it_is_memory_s_old() -> None:
    aborts, clock = make_early_aborts(memory_s=60.0)
    aborts.remember("young")
    aborts.remember("old")
    clock.now += 59.9
    assert aborts.take("young") is True
    clock.now += 0.1
    assert aborts.take("old") is False


def test_remembering_prunes_the_expired_oldest_first() -> None:
    aborts, clock = make_early_aborts(memory_s=60.0)
    aborts.remember("a")
    clock.now += 10.0
    aborts.remember("b")
    clock.now += 20.0
    aborts.remember("a")  # again: now the newest
    clock.now += 45.0
    aborts.remember("c")  # "b" is 65 s old (pruned), "a" 45 s (it would be 75 s)
    assert len(aborts) == 2
    assert (aborts.take("b"), aborts.take("a"), aborts.take("c")) == (False, True, True)
