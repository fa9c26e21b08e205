"""Steps that share one device (simulator/overlap.py) and the PD pair on one GPU
(`ClusterShape.shared_device`): half pools, overlapping steps slowed, slower than two GPUs."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import pytest
from sim_profiles import make_profile

from admission.config import AdmissionThresholds
from loadtests.goodput import parse_slo
from simulator.cluster import Simulation
from simulator.overlap import Lane, SharedDevice
from simulator.plan import gpus_of, label, shapes_of
from simulator.report import simulate
from simulator.shape import ClusterShape


class Clock:
    """A minimal event loop for the lanes alone."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()


def test_overlapping_steps_share_the_device_and_each_ends_when_its_work_is_done() -> None:
    clock = Clock()
    a, b = Lane("a", 2.0), Lane("b", 2.0)
    device = SharedDevice((a, b), clock.at, lambda: clock.now)
    ends: dict[str, float] = {}

    def end(name: str) -> Callable[[], None]:
        return lambda: ends.__setitem__(name, clock.now)

    device.start(a, 10.0, end("a"))
    # b starts at 2 s with 4 s of work: both run at half speed until b is done at 10 s (a
    # has 8 s left at 2 s, 4 s at 10 s), then a alone to 14 s
    clock.at(2.0, lambda: device.start(b, 4.0, end("b")))
    clock.run()
    assert ends == pytest.approx({"a": 14.0, "b": 10.0})
    assert device.busy_s == pytest.approx(14.0)
    assert a.beside and b.beside


def test_a_lane_alone_runs_at_full_speed_and_one_step_at_a_time() -> None:
    clock = Clock()
    a, b = Lane("a", 3.0), Lane("b", 3.0)
    device = SharedDevice((a, b), clock.at, lambda: clock.now)
    ends = []
    device.start(a, 1.5, lambda: ends.append(clock.now))
    with pytest.raises(RuntimeError, match="already in flight"):
        device.start(a, 1.0, lambda: None)
    clock.run()
    assert ends == pytest.approx([1.5])
    assert not a.beside


PD = ClusterShape(1, 1, thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0))
SHARED = ClusterShape(
    1, 1, thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0), shared_device=True
)


def test_a_shared_device_halves_each_workers_pool() -> None:
    sim = Simulation(make_profile(), SHARED)
    assert [w.total_blocks for w in sim.workers.values()] == [512, 512]
    assert [w.total_blocks for w in Simulation(make_profile(), PD).workers.values()] == [1024] * 2


def test_pd_on_one_shared_device_is_slower_than_on_two_at_the_same_load() -> None:
    slo = parse_slo(["ttft:1000", "tpot:100"])
    two = simulate(make_profile(), PD, "synthetic", 4.0, 20.0, slo, seed=3).report
    one = simulate(make_profile(), SHARED, "synthetic", 4.0, 20.0, slo, seed=3).report
    assert one.requests == two.requests > 50
    assert one.ttft.p50 > 1.2 * two.ttft.p50
    assert one.tpot.p50 > 1.2 * two.tpot.p50
    assert one.e2e.p50 > two.e2e.p50


def test_shared_device_is_pairs_of_prefill_and_decode_workers_only() -> None:
    with pytest.raises(ValueError, match="--shared-device: one prefill worker per decode"):
        ClusterShape(1, 2, shared_device=True)
    with pytest.raises(ValueError, match="--shared-device: pairs"):
        ClusterShape(1, 1, 1, shared_device=True)
    with pytest.raises(ValueError, match="--shared-device-slowdown"):
        ClusterShape(1, 1, shared_device=True, shared_device_slowdown=0.9)


def test_plan_labels_and_counts_gpus_of_the_new_shapes() -> None:
    assert (label(SHARED), gpus_of(SHARED)) == ("1P1D shared", 1)
    assert (label(ClusterShape(0, 0, 0, 2)), gpus_of(ClusterShape(0, 0, 0, 2))) == ("2S", 2)
    thresholds = ClusterShape().thresholds
    assert [label(s) for s in shapes_of(2, thresholds, split=True)] == ["1P1D", "2C", "2S"]
    assert [label(s) for s in shapes_of(2, thresholds)] == ["1P1D", "2C"]
