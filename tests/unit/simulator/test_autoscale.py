"""The simulated cluster as the planner loop's host (simulator/autoscale.py), on the hand-made
profile (prefill 10 ms + 1 ms per token, hand-off 5 ms): a worker asked for serves only after
its start-up, a draining one takes no new request and stops only once idle, and every
worker's span is kept."""

from __future__ import annotations

import asyncio

from sim_profiles import make_profile

from admission.config import AdmissionThresholds
from loadtests.workload import PlannedRequest
from simulator.autoscale import SimHost
from simulator.cluster import Simulation
from simulator.shape import ClusterShape
from vocabulary.worker_api import WorkerRole


def make_request(index: int, prompt: int, max_tokens: int, at: float) -> PlannedRequest:
    tokens = tuple(10 + (index * 7919 + i) % 400 for i in range(prompt))
    return PlannedRequest(index, f"r{index}", at, tokens, max_tokens)


def test_a_worker_serves_after_its_start_up_and_stops_only_once_drained_and_idle() -> None:
    shape = ClusterShape(1, 1, thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0))
    sim = Simulation(make_profile(), shape)
    host = SimHost(sim, startup_s=1.0)
    sim.at(0.0, lambda: host.spawn_worker(WorkerRole.PREFILL))
    sim.at(1.55, lambda: host.begin_drain("p1"))
    sim.at(1.56, lambda: host.stop_when_drained("p1"))  # still prefilling r3
    sim.at(3.0, lambda: host.stop_when_drained("p1"))
    planned = [
        make_request(0, 100, 2, 0.5), make_request(1, 100, 2, 0.5),  # p1 is starting
        make_request(2, 100, 2, 1.5), make_request(3, 100, 2, 1.5),  # p1 serves
        make_request(4, 100, 2, 2.5), make_request(5, 100, 2, 2.5),  # p1 is draining
    ]  # fmt: skip
    done = sim.run(planned)
    assert [r.prefill_worker for r in done] == ["p0", "p0", "p0", "p1", "p0", "p0"]
    assert [e.strip() for e in host.events] == ["1.6s p1 still has in-flight work; not stopped"]
    p0, d0, p1 = (host.spans[w] for w in ("p0", "d0", "p1"))
    assert (p0.requested_s, p0.ready_s, p0.stopped_s) == (0.0, 0.0, None)
    assert (p1.requested_s, p1.ready_s, p1.draining_s, p1.stopped_s) == (0.0, 1.0, 1.55, 3.0)
    assert p1.seconds(end_s=10.0) == 3.0 and d0.seconds(end_s=10.0) == 10.0
    assert "p1" not in sim.workers


def test_the_host_reports_a_starting_worker_without_load_and_a_draining_one_as_draining() -> None:
    sim = Simulation(make_profile(), ClusterShape(1, 1))
    host = SimHost(sim, startup_s=5.0)
    host.spawn_worker(WorkerRole.DECODE)
    host.begin_drain("p0")
    snaps = {s.worker_id: s for s in asyncio.run(host.worker_snapshots())}
    assert snaps["d1"].ready_at_s is None and snaps["d1"].load is None
    assert snaps["p0"].draining and snaps["p0"].load is not None
    assert not snaps["d0"].draining and snaps["d0"].ready_at_s == 0.0
