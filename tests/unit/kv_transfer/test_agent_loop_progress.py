"""AgentLoop progress: each completed iteration (commands, tick, sleep) is stamped; work
pending is commands queued or running, or what the owner reports (a decode endpoint's
transfers, a prefill endpoint's leases). A blocked command or a tick that never returns shows
as a stall; a thread that died is reported and refuses new commands."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from kvt_factories import MODEL, SPEC, LoopbackFabric, filled_cache, loopback_factory, make_handle

from engine.kv.kv_cache import KVCache
from kv_transfer.agent_loop import AgentLoop, LoopStopped
from kv_transfer.config import KVTransferConfig
from kv_transfer.decode_endpoint import DecodeEndpoint
from kv_transfer.prefill_endpoint import PrefillEndpoint
from vocabulary.loop_progress import LoopProgress, LoopState

pytestmark = pytest.mark.timeout(30)

TICK_S = 0.02
FRESH_S = 1.0
"""A healthy loop's `stalled_s` stays below this (it sleeps 0.02 s; slack for a loaded CI)."""
FAST = KVTransferConfig(
    lease_s=5.0, reaper_interval_s=0.02, idle_tick_s=TICK_S, heartbeat_interval_s=0.05
)


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class Owner:
    """The loop's owner: a tick that may be made to hang, and work it reports."""

    def __init__(self) -> None:
        self.busy = False
        self.hang = threading.Event()
        self.release = threading.Event()

    def tick(self) -> float:
        if self.hang.is_set():
            self.release.wait()
        return TICK_S


@pytest.fixture()
def fabric() -> LoopbackFabric:
    return LoopbackFabric()


@pytest.fixture()
def owner() -> Owner:
    return Owner()


@pytest.fixture()
def loop(owner: Owner) -> Iterator[AgentLoop]:
    lp = AgentLoop("kv-test", owner.tick, TICK_S, has_work=lambda: owner.busy)
    lp.start(lambda: None, timeout_s=5.0)
    yield lp
    owner.release.set()
    lp.stop(lambda: None, timeout_s=5.0)


def test_states_new_running_stopped(owner: Owner) -> None:
    lp = AgentLoop("kv-test", owner.tick, TICK_S)
    assert lp.progress().state is LoopState.NEW
    lp.start(lambda: None, timeout_s=5.0)
    assert lp.progress().state is LoopState.RUNNING
    lp.stop(lambda: None, timeout_s=5.0)
    assert lp.progress().state is LoopState.STOPPED


def test_an_idle_loop_has_no_work_and_keeps_completing_iterations(loop: AgentLoop) -> None:
    time.sleep(0.2)
    for _ in range(5):
        p = loop.progress()
        assert p.state is LoopState.RUNNING and not p.has_work and p.stalled_s < FRESH_S
        time.sleep(0.03)


def test_work_the_owner_reports_counts_and_a_ticking_loop_stays_fresh(
    loop: AgentLoop, owner: Owner
) -> None:
    owner.busy = True
    time.sleep(0.2)
    p = loop.progress()
    assert p.has_work and p.stalled_s < FRESH_S


def test_a_blocked_command_is_pending_work_that_makes_no_progress(loop: AgentLoop) -> None:
    gate = threading.Event()
    loop.post(gate.wait)
    time.sleep(0.5)
    stuck = loop.progress()
    assert stuck == LoopProgress(LoopState.RUNNING, True, stuck.stalled_s)
    assert stuck.stalled_s >= 0.5 - TICK_S
    gate.set()
    wait_for(lambda: not loop.progress().has_work)
    assert loop.progress().stalled_s < FRESH_S


def test_a_hung_tick_stalls_with_work_only_once_work_is_pending(
    loop: AgentLoop, owner: Owner
) -> None:
    owner.hang.set()
    time.sleep(0.5)
    idle = loop.progress()
    assert not idle.has_work and idle.stalled_s >= 0.4  # stuck, but nothing waits on it
    loop.post(lambda: None)  # work arrives: now it is a stall
    busy = loop.progress()
    assert busy.has_work and busy.stalled_s >= 0.4


def test_a_thread_that_died_is_reported_and_refuses_commands(owner: Owner) -> None:
    class Fatal(BaseException):
        pass

    def tick() -> float:
        raise Fatal("agent corrupted")  # not an Exception: the loop's guards let it through

    lp = AgentLoop("kv-test", tick, TICK_S)
    lp.start(lambda: None, timeout_s=5.0)
    wait_for(lambda: lp.progress().state is LoopState.DIED)
    assert lp.progress().error == "Fatal: agent corrupted"
    with pytest.raises(LoopStopped, match="died"):
        lp.post(lambda: None)


def test_a_prefill_endpoint_has_work_while_it_holds_leases(fabric: LoopbackFabric) -> None:
    released = threading.Event()
    ep = PrefillEndpoint(
        filled_cache(), MODEL, "p0", lambda rid, b: released.set(), FAST, loopback_factory(fabric)
    )
    ep.start()
    try:
        assert not ep.progress().has_work
        ep.hand_off("r1", (1, 2), (), num_tokens=2 * SPEC.block_size, lease_s=0.2)
        p = ep.progress()
        assert p.state is LoopState.RUNNING and p.has_work and p.stalled_s < FRESH_S
        assert released.wait(5)  # the lease expired: nothing held any more
        wait_for(lambda: not ep.progress().has_work)
    finally:
        ep.close()


def test_a_decode_endpoint_has_work_while_a_transfer_is_in_flight(
    fabric: LoopbackFabric,
) -> None:
    fabric.auto_complete = False
    prefill = PrefillEndpoint(
        filled_cache(), MODEL, "p0", lambda rid, b: None, FAST, loopback_factory(fabric)
    )
    outcomes: list[object] = []
    decode = DecodeEndpoint(
        KVCache(SPEC),
        MODEL,
        "d0",
        outcomes.append,
        outcomes.append,
        FAST,
        loopback_factory(fabric),
    )
    info = prefill.start()
    decode.start()
    try:
        decode.add_peer(info)
        assert not decode.progress().has_work
        handle = make_handle("r1", (1, 2), time.time() + 5, agent_name=info.agent_name)
        decode.submit(handle, (3, 4))
        wait_for(lambda: decode.load().in_flight_transfers == 1)
        p = decode.progress()
        assert p.state is LoopState.RUNNING and p.has_work and p.stalled_s < FRESH_S
        assert fabric.complete("r1")
        wait_for(lambda: bool(outcomes))
        wait_for(lambda: not decode.progress().has_work)
    finally:
        decode.close()
        prefill.close()
