"""The local-prefill policies in the simulator, which calls the router's own placement: exact
runs on the hand-made profile (prefill 10 ms + 1 ms per token, decode 10 ms a step, hand-off
5 ms) where the `cost` policy avoids what the fixed threshold cannot see (a prefill queue, the
streams a local prefill stalls), and the seeded comparison docs/benchmarks.md reports ("Local
prefill"), held on the tiny model's CPU profile."""

from __future__ import annotations

import pytest
from sim_profiles import make_profile, tiny_cpu_profile

from loadtests.goodput import parse_slo
from loadtests.workload import PlannedRequest
from router.placement import PrefillReason
from router.prefill_cost import LocalPrefillPolicy
from simulator.cluster import Simulation
from simulator.report import simulate, to_record
from simulator.shape import ClusterShape
from simulator.workers import SimRequest

THRESHOLD = ClusterShape(1, 1)  # admission's default threshold: 64 uncached tokens
COST = ClusterShape(1, 1, local_prefill=LocalPrefillPolicy.COST)


def make_request(index: int, prompt: int, max_tokens: int, at: float = 0.0) -> PlannedRequest:
    tokens = tuple(10 + (index * 7919 + i) % 400 for i in range(prompt))
    return PlannedRequest(index, f"r{index}", at, tokens, max_tokens)


def run(shape: ClusterShape, planned: list[PlannedRequest]) -> list[SimRequest]:
    return Simulation(make_profile(), shape, trace_tokens=True).run(planned)


def test_a_prompt_behind_a_long_prefill_is_prefilled_on_the_decode_worker() -> None:
    # one stream decodes on d0 (its 16-token prompt prefilled there under both policies), then
    # a 500-token prompt goes to p0 (cost: 510 + 10 + 510 ms locally against 515 ms), then a
    # 100-token one arrives while p0 computes the long one
    planned = [
        make_request(0, 16, 100),
        make_request(1, 500, 5, 0.1),
        make_request(2, 100, 3, 0.11),
    ]
    _, long_one, behind = run(THRESHOLD, planned)
    assert long_one.placement is PrefillReason.OVER_THRESHOLD
    assert behind.placement is PrefillReason.OVER_THRESHOLD
    assert to_record(behind, None).ttft_ms == pytest.approx(610.0)  # p0's 0.1-0.61 s first
    _, long_one, local = run(COST, planned)
    assert long_one.placement is PrefillReason.REMOTE_CHEAPER
    # locally 110 ms + a 10 ms step + 2 * 110 ms (the stream, and the long prompt placed
    # there) against p0's 610 ms for both prompts and the hand-off: it joins d0's step
    # after the one under way (0.106-0.116 s): 10 ms of decode + 110 ms of prefill
    assert local.placement is PrefillReason.LOCAL_CHEAPER
    assert to_record(local, None).ttft_ms == pytest.approx(126.0)


def test_a_short_prompt_goes_to_the_idle_prefill_worker_instead_of_stalling_four_streams() -> None:
    streams = [make_request(i, 100, 200, at=0.01 * i) for i in range(4)]
    short = make_request(4, 40, 3, at=1.0)
    gap, placed = {}, {}
    for name, shape in (("threshold", THRESHOLD), ("cost", COST)):
        done = run(shape, [*streams, short])
        gap[name] = max(
            b - a
            for r in done[:4]
            for a, b in zip(r.token_times, r.token_times[1:], strict=False)
            if a >= 0.5
        )
        placed[name] = done[4].placement
    # the threshold prefills its 40 tokens in a step with the 4 decodes: 10 + 50 ms
    assert placed["threshold"] is PrefillReason.UNDER_THRESHOLD
    assert gap["threshold"] == pytest.approx(0.06)
    # cost: 50 + 10 + 4 * 50 ms locally against 50 + 5 ms remotely
    assert placed["cost"] is PrefillReason.REMOTE_CHEAPER
    assert gap["cost"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("workload", "rate", "threshold_goodput", "cost_goodput"),
    [("mixed", 8.0, 6.22, 6.36), ("synthetic", 8.0, 6.68, 8.88)],
)
def test_the_cost_policy_beats_the_threshold_on_the_same_seeded_workload(
    workload: str, rate: float, threshold_goodput: float, cost_goodput: float
) -> None:
    slo = parse_slo(["ttft:200", "tpot:20"])
    got = {}
    for policy in LocalPrefillPolicy:
        shape = ClusterShape(1, 1, kv_blocks=1024, local_prefill=policy)
        got[policy] = simulate(tiny_cpu_profile(), shape, workload, rate, 60.0, slo, seed=0)
    threshold = got[LocalPrefillPolicy.THRESHOLD].report
    cost = got[LocalPrefillPolicy.COST].report
    assert threshold.requests == cost.requests  # the same requests, seeded
    assert threshold.goodput_rps == pytest.approx(threshold_goodput, abs=0.05)
    assert cost.goodput_rps == pytest.approx(cost_goodput, abs=0.05)
    assert cost.ttft.p90 < threshold.ttft.p90
    assert cost.tpot.p90 <= threshold.tpot.p90 * 1.1
