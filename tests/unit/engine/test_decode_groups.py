"""The cross-step pipeline's groups (engine/core/decode_groups.py): which running requests a
step computes, and how the groups form, settle and rebalance over a real `Scheduler` driven
as `PipelinedSteps` drives it (G steps in flight, the oldest read first)."""

from __future__ import annotations

from collections import deque

import pytest
from scheduler_factories import make_request, make_scheduler

from engine.core.decode_groups import is_decoding, schedulable
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler


def test_schedulable_leaves_out_requests_in_flight_and_decodes_past_the_share() -> None:
    s = make_scheduler(64, budget=64)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, first_token=100 * i))
    s.schedule()  # every prompt in one step: each samples, so each is in flight
    assert all(r.num_output_placeholders == 1 and is_decoding(r) for r in s.running)
    assert schedulable(s.running, 2) == frozenset()
    for r in s.running[:4]:  # the step is read for them ("r4" stays in flight)
        r.append_output(7, None)
    # 5 decoding over 2 groups: at most 3 a step, oldest first; "r4" is in flight
    assert schedulable(s.running, 2) == {"r0", "r1", "r2"}
    assert schedulable(s.running, 1) == {"r0", "r1", "r2", "r3"}
    assert schedulable(s.running, 5) == {"r0"}
    with pytest.raises(ValueError, match="decode groups: must be >= 1"):
        schedulable(s.running, 0)


def test_a_prompt_mid_prefill_is_always_schedulable_and_not_a_decode() -> None:
    s = make_scheduler(64, budget=6)
    s.add_request(make_request("long", 20))
    s.schedule()  # 6 of 20 prompt tokens: no sample, not in flight
    (long,) = s.running
    assert not long.num_output_placeholders and not is_decoding(long)
    assert schedulable(s.running, 4) == {"long"}


class Pipeline:
    """A scheduler driven as `PipelinedSteps.step` drives it: each step reads the oldest of
    `depth` steps in flight (appending token 7 to what it sampled, finishing requests at
    their max_tokens), schedules with `schedulable` and launches."""

    def __init__(self, scheduler: Scheduler, depth: int) -> None:
        self.s = scheduler
        self.depth = depth
        self.in_flight: deque[list[str]] = deque()
        self.decode_sizes: list[int] = []

    def step(self) -> None:
        if len(self.in_flight) >= self.depth:
            self.read()
        out = self.s.schedule(schedulable(self.s.running, self.depth))
        sampled = [c.request_id for c in out.batch.chunks if c.sample]
        flying = {rid for step in self.in_flight for rid in step}
        assert not flying & {c.request_id for c in out.batch.chunks}  # never twice in flight
        assert not any(c.placeholder for c in out.batch.chunks)
        if out.batch.chunks:
            self.in_flight.append(sampled)
            if out.batch.is_decode_only:
                self.decode_sizes.append(len(out.batch.chunks))
        elif self.in_flight:
            self.read()

    def read(self) -> None:
        for rid in self.in_flight.popleft():
            request = self.s.requests.get(rid)
            if request is None:
                continue  # (aborted while in flight: its token is discarded)
            request.append_output(7, None)
            self.s.cache_computed_blocks(request)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.s.finish(request, RequestStatus.FINISHED_LENGTH)

    def run(self) -> None:
        for _ in range(1000):
            if not self.s.has_unfinished() and not self.in_flight:
                return
            self.step()
        raise AssertionError("the pipeline did not drain")


def test_a_burst_settles_into_equal_groups_in_flight_at_once() -> None:
    s = make_scheduler(128, max_num_seqs=16, budget=64)
    for i in range(8):
        s.add_request(make_request(f"r{i}", 4, first_token=100 * i, max_tokens=6))
    p = Pipeline(s, 2)
    p.run()
    # all 8 prefilled in one step (one group), then split: 4 and 4 until they end
    assert p.decode_sizes == [4] * 10
    assert s.block_pool.num_free == s.block_pool.num_blocks


def test_groups_shrunk_by_finished_requests_take_the_others_in() -> None:
    s = make_scheduler(128, max_num_seqs=16, budget=64)
    lengths = [3, 3, 3, 20, 20, 20, 20, 20]  # three of the first group end early
    for i, n in enumerate(lengths):
        s.add_request(make_request(f"r{i}", 4, first_token=100 * i, max_tokens=n))
    p = Pipeline(s, 2)
    p.run()
    sizes = p.decode_sizes
    # groups {r0-r3} and {r4-r7}; r0-r2 end after their 2nd decode, leaving {r3}: five
    # decoding, at most ceil(5 / 2) = 3 a step, so the other group leaves r7, which joins r3
    # at the next step: 3 and 2 from then on (r7, a step behind, ends last, alone)
    assert sizes == [4, 4, 4, 4, 1] + [3, 2] * 16 + [3, 1], sizes
    assert sum(sizes) == 3 * 2 + 5 * 19  # every decode (a request's first token: its prefill)


def test_an_abort_and_a_late_arrival_keep_groups_disjoint_and_free_every_block() -> None:
    s = make_scheduler(64, max_num_seqs=16, budget=64)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, first_token=100 * i, max_tokens=8))
    p = Pipeline(s, 3)
    for _ in range(4):
        p.step()
    flying = {rid for step in p.in_flight for rid in step}
    assert "r1" in flying
    assert s.abort("r1")  # in flight: its blocks back at once, its token discarded later
    s.add_request(make_request("late", 9, first_token=900, max_tokens=5))
    p.run()
    assert s.block_pool.num_free == s.block_pool.num_blocks
    assert max(p.decode_sizes) <= 2  # ceil(4 / 3)
