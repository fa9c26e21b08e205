"""The simulator on a hand-made profile: prefill 10 ms + 1 ms per token, decode 10 ms a step
whatever the batch, hand-off 5 ms; exact answers for one request, chunking, a full decode
pool, and seeded runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_profiles import make_profile

from admission.config import AdmissionThresholds
from loadtests.goodput import parse_slo
from loadtests.workload import PlannedRequest
from planner.perf_profile import ServingOverhead
from simulator.cluster import Simulation
from simulator.report import simulate, to_record
from simulator.shape import ClusterShape


def make_request(index: int, prompt: int, max_tokens: int, at: float = 0.0) -> PlannedRequest:
    tokens = tuple(10 + (index * 7919 + i) % 400 for i in range(prompt))
    return PlannedRequest(index, f"r{index}", at, tokens, max_tokens)


DISAGGREGATED = ClusterShape(1, 1, thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0))


def test_one_request_alone_is_prefill_then_handoff_then_one_decode_step_per_token() -> None:
    (r,) = Simulation(make_profile(), DISAGGREGATED, trace_tokens=True).run(
        [make_request(0, 100, 5)]
    )
    record = to_record(r, None)
    assert record.ok
    assert record.ttft_ms == pytest.approx(110.0)  # no queue; one prefill step (10 + 100 ms)
    # the hand-off lands at 115 ms; 4 decode steps of 10 ms: tokens at 125, 135, 145, 155 ms
    assert r.token_times == pytest.approx([0.11, 0.125, 0.135, 0.145, 0.155])
    assert record.tpot_ms == pytest.approx(45.0 / 4)
    assert record.e2e_ms == pytest.approx(155.0)
    assert record.server_transfer_ms == pytest.approx(5.0)


def test_serving_overheads_add_a_router_hop_scale_prefill_and_lengthen_decode_steps() -> None:
    serving = ServingOverhead(request_s=0.002, prefill_factor=2.0, decode_step_s=0.001)
    profile = replace(make_profile(), serving=serving)
    (r,) = Simulation(profile, DISAGGREGATED, trace_tokens=True).run([make_request(0, 100, 3)])
    # hop 2 ms, prefill 2 x 110 ms; hand-off 5 ms; decode steps 10 + 1 ms
    assert r.token_times == pytest.approx([0.222, 0.238, 0.249])


def test_a_long_prompt_is_chunked_at_the_token_budget() -> None:
    (r,) = Simulation(make_profile(128), DISAGGREGATED).run([make_request(0, 300, 1)])
    # 128 + 128 + 44 tokens: three steps of 10 ms overhead each
    assert to_record(r, None).ttft_ms == pytest.approx(138.0 + 138.0 + 54.0)


def test_prompts_that_wait_for_a_busy_worker_share_its_next_step() -> None:
    first, a, b = Simulation(make_profile(), DISAGGREGATED, trace_tokens=True).run(
        [make_request(0, 50, 1), make_request(1, 50, 1), make_request(2, 50, 1)]
    )
    assert first.token_times == pytest.approx([0.06])  # the worker was idle: it starts at once
    assert a.token_times == b.token_times == pytest.approx([0.06 + 0.11])  # 100 tokens


def test_a_burst_placed_within_one_router_hop_spreads_over_the_prefill_workers() -> None:
    # eight 100-token prompts at once, a 10 ms hop before each reaches its worker: each is
    # counted on its prefill worker from placement on (as the live router counts what it
    # dispatched), so the next one sees it and goes elsewhere: p0-p3, then p0-p3 again
    profile = replace(make_profile(), serving=ServingOverhead(request_s=0.01))
    sim = Simulation(profile, replace(DISAGGREGATED, prefill=4))
    done = sim.run([make_request(i, 100, 1) for i in range(8)])
    assert [w.busy_s for w in sim.prefill] == pytest.approx([0.22] * 4)  # two 110 ms steps each
    # hop 10 ms, then the first prompt's step; the second's after it
    assert [to_record(r, None).ttft_ms for r in done] == pytest.approx([120.0] * 4 + [230.0] * 4)
    assert all(w.dispatched_prefill_tokens == 0 for w in sim.prefill)


def test_a_full_decode_pool_queues_the_next_request_until_the_first_finishes() -> None:
    # 100 + 100 tokens = 13 blocks each; 95 % of 20 blocks holds one
    thresholds = AdmissionThresholds(local_prefill_threshold_tokens=0, max_queue_wait_ms=10_000)
    shape = ClusterShape(1, 1, kv_blocks=20, thresholds=thresholds)
    first, second = Simulation(make_profile(), shape).run(
        [make_request(0, 100, 100), make_request(1, 100, 100)]
    )
    assert first.status == second.status == "OK"
    assert first.done_s == pytest.approx(0.11 + 0.005 + 99 * 0.01)
    # admitted when the first released its reservation: its prefill starts then
    assert second.first_token_s == pytest.approx(first.done_s + 0.11)


def test_a_full_decode_pool_rejects_when_queueing_is_off() -> None:
    thresholds = AdmissionThresholds(local_prefill_threshold_tokens=0, max_queue_wait_ms=0)
    shape = ClusterShape(1, 1, kv_blocks=20, thresholds=thresholds)
    first, second = Simulation(make_profile(), shape).run(
        [make_request(0, 100, 100), make_request(1, 100, 100)]
    )
    assert (first.status, second.status) == ("OK", "RESOURCE_EXHAUSTED")
    assert to_record(second, None).ttft_ms is None


def test_a_short_prompt_is_prefilled_on_the_decode_worker_without_a_handoff() -> None:
    shape = ClusterShape(1, 1, thresholds=AdmissionThresholds(local_prefill_threshold_tokens=64))
    (r,) = Simulation(make_profile(), shape, trace_tokens=True).run([make_request(0, 50, 3)])
    assert r.handoff_s == 0.0
    assert r.token_times == pytest.approx([0.06, 0.07, 0.08])


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    slo = parse_slo("ttft:1000 tpot:100")
    runs = [
        simulate(make_profile(), DISAGGREGATED, "synthetic", 4.0, 10.0, slo, seed=s).records
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(runs[0]) > 10


def test_a_cluster_without_a_decoding_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="--decode"):
        ClusterShape(prefill=2, decode=0)
