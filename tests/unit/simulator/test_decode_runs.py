"""Decode runs (simulator/workers.py `DecodeRun`): a worker's decode steps over an unchanged
batch are applied by one event up to the first that takes a block or finishes a request, and
work reaching the worker cuts the run at the step under way; the token times are those of one
event per step. The hand-made profile of test_simulation: decode 10 ms a step, hand-off 5 ms,
prefill 10 ms + 1 ms a token."""

from __future__ import annotations

import itertools

import pytest
from sim_profiles import make_profile
from test_simulation import DISAGGREGATED, make_request

from simulator.cluster import Simulation


def test_a_lone_stream_takes_one_event_per_block_boundary_not_per_step() -> None:
    sim = Simulation(make_profile(), DISAGGREGATED, trace_tokens=True)
    (r,) = sim.run([make_request(0, 100, 40)])
    # first token at 110 ms, hand-off 5 ms, then 39 steps of 10 ms
    assert r.token_times == pytest.approx([0.11] + [0.115 + 0.01 * i for i in range(1, 40)])
    # arrival, prefill step, hand-off; runs of 13 steps (the 112th token starts a block), 16
    # (the 128th) and 10 (the last token)
    assert sim.events == 6
    assert sim.decode[0].busy_s == pytest.approx(0.39)


def test_a_hand_off_during_a_run_joins_the_batch_after_the_step_under_way() -> None:
    sim = Simulation(make_profile(), DISAGGREGATED, trace_tokens=True)
    a, b = sim.run([make_request(0, 100, 40), make_request(1, 100, 3, at=0.203)])
    # b: prefill 203-313 ms, hand-off lands at 318 ms during a's step of 315-325 ms: its
    # first decode step is the next one, 325-335 ms
    assert b.token_times == pytest.approx([0.313, 0.335, 0.345])
    assert a.token_times == pytest.approx([0.11] + [0.115 + 0.01 * i for i in range(1, 40)])
    assert a.done_s == pytest.approx(0.505)
    gaps = [y - x for x, y in itertools.pairwise(a.token_times or ())]
    assert sim.gaps.count == len(gaps) + 2
