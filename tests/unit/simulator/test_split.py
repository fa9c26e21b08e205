"""The simulated split worker on the hand-made profile (prefill 10 ms + 1 ms per token, decode
10 ms a step): the engine's own split decisions, each loop at full speed while the other is
idle, what the split buys and costs against a colocated worker, and the pool under pressure.

The profile's decode step is 10 ms on the whole device, so the split model infers 25.7 GB of
weights (bandwidth 2649 GB/s, launch 0.3 ms); the default curve saturates at 59 of 132 SMs,
and the adaptive shares of 132 SMs are 16, 32, 48, 64 and 88."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
from sim_profiles import make_profile

from admission.config import AdmissionThresholds
from loadtests.workload import PlannedRequest
from simulator.cluster import Simulation
from simulator.report import to_record
from simulator.shape import ClusterShape
from simulator.split import SplitParams, SplitWorker, split_model
from simulator.workers import SimRequest, block_hashes
from vocabulary.split_policy import choose_decode_sms

LOOSE = AdmissionThresholds(
    max_estimated_ttft_ms=600_000.0, max_queue_wait_ms=600_000.0, max_inflight_requests=4096,
    max_decode_kv_utilization=1.0, local_prefill_threshold_tokens=0,
)  # fmt: skip
"""Nothing refused or queued for load (the goodput suite's admission)."""
SATURATED = 59  # round(132 * 0.45): the default curve's knee


def make_request(index: int, prompt: int, max_tokens: int, at: float = 0.0) -> PlannedRequest:
    tokens = tuple(10 + (index * 7919 + i) % 400 for i in range(prompt))
    return PlannedRequest(index, f"r{index}", at, tokens, max_tokens)


def split_shape(**params: float) -> ClusterShape:
    return ClusterShape(0, 0, 0, 1, thresholds=LOOSE, split_params=SplitParams(**params))  # type: ignore[arg-type]


def the_split_worker(sim: Simulation) -> SplitWorker:
    (worker,) = sim.decode
    assert isinstance(worker, SplitWorker)
    return worker


def test_every_split_decision_is_the_engines_choose_decode_sms_for_the_same_load() -> None:
    # decode streams, then a stream of prompts beside them, then decode alone again
    planned = [make_request(i, 16, 120) for i in range(6)]
    planned += [make_request(6 + i, 200, 2, at=0.3 + 0.25 * i) for i in range(12)]
    sim = Simulation(make_profile(), split_shape(resize_interval_s=0.5))
    sim.run(planned)
    worker = the_split_worker(sim)
    params = worker.params
    model = split_model(make_profile(), params)
    assert len(worker.decisions) > 50
    for d in worker.decisions:
        expected = choose_decode_sms(
            d.load, params.shares(), params.total_sms, replace(model, slowdown=d.slowdown),
            params.tpot_target_s,
        )  # fmt: skip
        assert d.wanted == expected, d
    wanted = {d.wanted for d in worker.decisions}
    assert 132 in wanted and wanted & {16, 32, 48, 64, 88}  # both sides of the policy ran
    # the split moves at most once per resize interval, always to what was wanted then
    changes = [d for prev, d in itertools.pairwise(worker.decisions)
               if d.decode_sms != prev.decode_sms]  # fmt: skip
    assert changes and all(d.decode_sms == d.wanted for d in changes)
    times = [d.at_s for d in changes]
    assert all(b - a >= 0.5 for a, b in itertools.pairwise(times))
    # the correction learned the decode steps' slowdown beside prefill from simulated steps
    assert worker.correction.samples > 0 and worker.correction.factor > 1.0


def test_with_the_prefill_loop_idle_decode_runs_at_the_whole_devices_speed() -> None:
    (r,) = Simulation(make_profile(), split_shape(resize_interval_s=0.0), trace_tokens=True).run(
        [make_request(0, 100, 4)]
    )
    # prefill alone (nothing decodes: the smallest decode share, 16 SMs, is kept; prefill runs
    # on the other 116 without a slowdown), then every SM to decode: the profile's 10 ms steps
    first = 0.11 * 132 / 116
    assert r.token_times == pytest.approx([first, first + 0.01, first + 0.02, first + 0.03])


def test_the_governor_holds_the_split_for_its_interval_even_when_prefill_goes_idle() -> None:
    (r,) = Simulation(make_profile(), split_shape(), trace_tokens=True).run(
        [make_request(0, 100, 3)]
    )
    # the split moved to 16 decode SMs at 0 s; within 1 s it stays, so decode draws 16 of
    # the 59 SMs the bandwidth needs: 10 ms x 59 / 16 a step
    first, step = 0.11 * 132 / 116, 0.01 * SATURATED / 16
    assert r.token_times == pytest.approx([first, first + step, first + 2 * step])


def test_with_decode_idle_a_fixed_split_prefills_on_its_partition_without_a_slowdown() -> None:
    (r,) = Simulation(make_profile(), split_shape(decode_sms=32), trace_tokens=True).run(
        [make_request(0, 100, 1)]
    )
    assert r.token_times == pytest.approx([0.11 * 132 / 100])


def test_steps_that_overlap_run_at_their_measured_slowdowns() -> None:
    params = SplitParams(decode_sms=48, resize_interval_s=0.0)
    sim = Simulation(make_profile(), replace(split_shape(), split_params=params), trace_tokens=True)
    a, b = sim.run([make_request(0, 16, 40), make_request(1, 100, 1, at=0.1)])
    # decode alone on 48 SMs: 10 ms x 59 / 48; beside the prefill x 1/0.74; the prefill on
    # 84 SMs, x 1/0.82 while decode steps (always, here)
    alone = 0.01 * SATURATED / 48
    steps = [y - x for x, y in itertools.pairwise(a.token_times)]
    assert min(steps) == pytest.approx(alone)
    assert max(steps) == pytest.approx(alone / 0.74)
    prefill = 0.11 * 132 / 84 / 0.82
    assert to_record(b, None).ttft_ms == pytest.approx(1000 * prefill)


def prefill_heavy() -> list[PlannedRequest]:
    """Eight decode streams, and a 400-token prompt every 100 ms beside them."""
    planned = [make_request(i, 16, 100, at=0.001 * i) for i in range(8)]
    return planned + [make_request(8 + i, 400, 2, at=0.05 + 0.1 * i) for i in range(15)]


def test_a_split_worker_holds_tpot_down_under_prefill_heavy_load_where_colocated_does_not() -> None:
    colocated = ClusterShape(0, 0, 1, thresholds=LOOSE)
    runs = {}
    for name, shape in (("colocated", colocated), ("split", split_shape())):
        done = Simulation(make_profile(), shape).run(prefill_heavy())
        runs[name] = sorted(to_record(r, None).tpot_ms or 0.0 for r in done[:8])
    # colocated: every step that carries a 400-token chunk takes 410 ms (TPOT ~71 ms); the
    # split's decode loop is sized for 20 ms on its own partition and never waits for a
    # prefill (~22 ms: the first steps beside prefill teach it the slowdown)
    assert max(runs["split"]) < 0.5 * min(runs["colocated"])
    assert max(runs["split"]) < 25.0


def test_a_split_worker_prefills_fewer_prompts_a_second_than_colocated() -> None:
    """Decode-free prefill (one token each): colocated prefills on every SM, the split keeps
    its smallest decode share and prefills on the rest."""
    planned = [make_request(i, 200, 1) for i in range(20)]
    ends = {}
    for name, shape in (("colocated", ClusterShape(0, 0, 1, thresholds=LOOSE)),
                        ("split", split_shape())):  # fmt: skip
        sim = Simulation(make_profile(), shape)
        ends[name] = max(r.last_token_s for r in sim.run(planned))
    assert ends["split"] == pytest.approx(ends["colocated"] * 132 / 116)


def admit_without_admission(sim: Simulation, planned: list[PlannedRequest]) -> None:
    """Place each request at its time without admission's worst-case reservation (which
    alone keeps a pool from filling): the split worker's own rules must hold the pool."""

    def arrive(p: PlannedRequest) -> None:
        r = SimRequest(p, block_hashes(p.token_ids, sim.block_size), sent_s=sim.now)
        sim.requests.append(r)
        sim._admit(r)

    for p in planned:
        sim.at(p.send_at_s, functools.partial(arrive, p))


def test_the_pool_never_overflows_under_pressure_and_prefill_leaves_the_headroom() -> None:
    # 64 blocks of 16 tokens; 12 requests that would end at 100 + 150 tokens (16 blocks) each
    sim = Simulation(make_profile(), replace(split_shape(), kv_blocks=64))
    worker = the_split_worker(sim)
    headroom_kept = []
    plan_prefill = worker.plan_prefill

    def checked(now: float) -> tuple[float, list[tuple[SimRequest, int]]]:
        seconds, chunks = plan_prefill(now)
        if chunks:
            headroom_kept.append(worker.free_blocks >= len(worker.running) + 8)
        return seconds, chunks

    worker.plan_prefill = checked  # type: ignore[method-assign]
    admit_without_admission(sim, [make_request(i, 100, 150, at=0.02 * i) for i in range(12)])
    done = sim.run([])
    assert headroom_kept and all(headroom_kept)
    assert worker.kv_overflows == 0
    assert worker.preemptions > 0  # the pool did run short: the decode loop gave blocks back
    assert [r.tokens for r in done] == [150] * 12
    assert worker.used_blocks == 0


def test_bad_split_input_names_its_flag() -> None:
    with pytest.raises(ValueError, match="--split: must be >= 0"):
        ClusterShape(split=-1)
    with pytest.raises(ValueError, match="--split-decode-sms"):
        SplitParams(decode_sms=132)
    with pytest.raises(ValueError, match="--split-tpot-ms"):
        SplitParams(tpot_target_s=0.0)
    with pytest.raises(ValueError, match="--split-decode-slowdown"):
        SplitParams(decode_slowdown=0.5)
    with pytest.raises(ValueError, match="--shared-device"):
        ClusterShape(0, 0, 0, 1, shared_device=True)
    ClusterShape(0, 0, 0, 1)  # split workers alone decode
