"""Scheduler: exact chunks, block tables, prefix reuse, preemption and hand-off bookkeeping."""

from __future__ import annotations

import pytest
from scheduler_factories import chunk_view, make_request, make_scheduler, run_step

from engine.core.request import RequestStatus
from engine.core.scheduler import UnknownRequestError
from engine.kv.block_pool import NoFreeBlocksError


def test_prompt_is_prefilled_in_one_chunk_then_decoded_one_token_at_a_time() -> None:
    s = make_scheduler()
    r = make_request("r1", prompt_len=6)
    s.add_request(r)
    assert chunk_view(run_step(s)) == [("r1", 0, 6, (0, 1), True)]
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 6
    out = run_step(s)
    assert chunk_view(out) == [("r1", 6, 1, (0, 1), True)]
    assert out.batch.chunks[0].token_ids == (7,)  # the token sampled by the previous step
    assert chunk_view(run_step(s)) == [("r1", 7, 1, (0, 1), True)]
    assert chunk_view(run_step(s)) == [("r1", 8, 1, (0, 1, 2), True)]  # a new block at 8


def test_chunked_prefill_splits_a_prompt_under_the_token_budget() -> None:
    s = make_scheduler(budget=4)
    s.add_request(make_request("r1", prompt_len=10))
    assert chunk_view(run_step(s)) == [("r1", 0, 4, (0,), False)]
    assert chunk_view(run_step(s)) == [("r1", 4, 4, (0, 1), False)]
    assert chunk_view(run_step(s)) == [("r1", 8, 2, (0, 1, 2), True)]
    assert s.requests["r1"].output_token_ids == [7]


def test_decodes_take_the_budget_first_and_prefill_chunks_lead_the_batch() -> None:
    s = make_scheduler(budget=5)
    s.add_request(make_request("r1", prompt_len=3))
    run_step(s)
    s.add_request(make_request("r2", prompt_len=10, first_token=200))
    out = run_step(s)
    assert chunk_view(out) == [("r2", 0, 4, (1,), False), ("r1", 3, 1, (0,), True)]
    assert s.num_pending_prefill_tokens() == 6


def test_max_num_seqs_bounds_the_running_batch() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_len=2, first_token=100 * (i + 1)))
    assert [c[0] for c in chunk_view(run_step(s))] == ["r0", "r1"]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_chunked_prefill_disabled_admits_only_whole_prompts() -> None:
    s = make_scheduler(budget=8, chunked=False)
    s.add_request(make_request("r1", prompt_len=6))
    s.add_request(make_request("r2", prompt_len=6, first_token=200))
    assert chunk_view(run_step(s)) == [("r1", 0, 6, (0, 1), True)]
    assert chunk_view(run_step(s)) == [("r2", 0, 6, (2, 3), True), ("r1", 6, 1, (0, 1), True)]


def test_prefix_cache_hit_reuses_full_blocks_and_recomputes_at_least_the_last_token() -> None:
    s = make_scheduler()
    s.add_request(make_request("r1", prompt_len=8, max_tokens=1))
    run_step(s)
    s.finish(s.requests["r1"], RequestStatus.FINISHED_LENGTH)
    assert s.block_pool.num_cached == 2
    # Same 8-token prompt: both blocks are cached, but the last token must be computed to
    # sample, so only block 0 is reused and the second block is recomputed into a new block.
    same = make_request("r2", prompt_len=8)
    s.add_request(same)
    assert chunk_view(run_step(s)) == [("r2", 4, 4, (0, 2), True)]
    assert same.num_cached_prompt_tokens == 4
    # A 9-token prompt that extends it reuses both full blocks.
    longer = make_request("r3", prompt_len=9)
    s.add_request(longer)
    assert chunk_view(run_step(s)) == [
        ("r2", 8, 1, (0, 2, 3), True),  # running first
        ("r3", 8, 1, (0, 1, 4), True),
    ]
    assert longer.num_cached_prompt_tokens == 8
    assert (s.num_cache_query_tokens, s.num_cache_hit_tokens) == (25, 12)
    assert [s.block_pool.ref_count(b) for b in (0, 1, 2, 3, 4)] == [2, 1, 1, 1, 1]
    assert s.block_pool.block_hash(2) is None  # same hash as block 1: not cached twice


def test_prefix_caching_disabled_never_reuses() -> None:
    s = make_scheduler(caching=False)
    s.add_request(make_request("r1", prompt_len=8, max_tokens=1))
    run_step(s)
    s.finish(s.requests["r1"], RequestStatus.FINISHED_LENGTH)
    s.add_request(make_request("r2", prompt_len=9))
    assert chunk_view(run_step(s)) == [("r2", 0, 9, (2, 3, 4), True)]


def test_decode_without_a_free_block_preempts_the_newest_request() -> None:
    s = make_scheduler(num_blocks=4)
    r1, r2 = make_request("r1", prompt_len=8), make_request("r2", prompt_len=8, first_token=200)
    s.add_request(r1)
    s.add_request(r2)
    assert chunk_view(run_step(s)) == [("r1", 0, 8, (0, 1), True), ("r2", 0, 8, (2, 3), True)]
    out = run_step(s)
    # r1 needs a block at position 8: r2 (newest) is preempted; its cached blocks become
    # evictable tail-first, so block 3 is evicted for r1 and block 2 stays cached.
    assert out.preempted == ("r2",)
    assert chunk_view(out) == [("r1", 8, 1, (0, 1, 3), True)]
    assert r2.status is RequestStatus.PREEMPTED and list(s.waiting) == [r2]
    assert (r2.block_ids, r2.num_computed_tokens, r2.num_preemptions) == ([], 0, 1)
    assert s.block_pool.match_prefix(r2.block_hashes) == [2]
    # r2 needs 3 blocks to recompute its 9 tokens; only block 2 can be had: it waits.
    assert chunk_view(run_step(s)) == [("r1", 9, 1, (0, 1, 3), True)]
    s.finish(r1, RequestStatus.FINISHED_STOPPED)
    # Re-admitted: block 2 reused from the cache, tokens 4..8 (prompt + 1 output) recomputed.
    assert chunk_view(run_step(s)) == [("r2", 4, 5, (2, 1, 3), True)]
    assert r2.output_token_ids == [7, 7]
    assert r2.num_cached_prompt_tokens == 0  # counted at first admission only
    assert s.num_preemptions == 1


def test_a_request_preempts_itself_when_it_is_the_newest() -> None:
    s = make_scheduler(num_blocks=3, keep=True)
    s.add_request(make_request("r1", prompt_len=4, max_tokens=1))
    run_step(s)
    s.finish(s.requests["r1"], RequestStatus.FINISHED_PREFILLED)  # holds block 0
    s.add_request(make_request("r2", prompt_len=8, first_token=200))
    run_step(s)
    out = run_step(s)
    assert out.preempted == ("r2",) and chunk_view(out) == []
    s.release("r1")
    # Its own evictable blocks 1 and 2 are prefix hits; only position 8 is recomputed, in
    # block 0 (the released hand-off block, least recently used).
    assert chunk_view(run_step(s)) == [("r2", 8, 1, (1, 2, 0), True)]


def test_request_needing_more_blocks_than_the_pool_finishes_with_length() -> None:
    s = make_scheduler(num_blocks=2)
    r = make_request("r1", prompt_len=7)
    s.add_request(r)
    run_step(s)
    run_step(s)  # decode at position 7 still fits block 1
    out = run_step(s)  # position 8 needs a third block
    assert out.finished == (r,) and chunk_view(out) == []
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert s.block_pool.num_free == 2 and not s.has_unfinished()


def test_waiting_is_fcfs_a_head_that_does_not_fit_blocks_later_requests() -> None:
    s = make_scheduler(num_blocks=4, budget=64)
    s.add_request(make_request("r1", prompt_len=8))
    run_step(s)
    s.add_request(make_request("big", prompt_len=12, first_token=200))
    s.add_request(make_request("small", prompt_len=2, first_token=300))
    assert [c[0] for c in chunk_view(run_step(s))] == ["r1"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_prefill_only_finish_keeps_blocks_until_release() -> None:
    s = make_scheduler(keep=True)
    r = make_request("r1", prompt_len=6)
    s.add_request(r)
    run_step(s)
    s.finish(r, RequestStatus.FINISHED_PREFILLED)
    assert s.handed_off == {"r1": r} and r.block_ids == [0, 1]
    assert [s.block_pool.ref_count(b) for b in (0, 1)] == [1, 1]
    assert s.num_handoff_blocks() == 2 and not s.has_unfinished()
    s.release("r1")
    assert s.block_pool.num_free == 16 and s.handed_off == {}
    with pytest.raises(UnknownRequestError):
        s.release("r1")


def test_abort_frees_a_running_or_waiting_request() -> None:
    s = make_scheduler(budget=4)
    s.add_request(make_request("r1", prompt_len=10))
    s.add_request(make_request("r2", prompt_len=3, first_token=200))
    run_step(s)
    assert s.abort("r1") and s.abort("r2") and not s.abort("r3")
    assert s.block_pool.num_free == 16
    assert (s.num_running, s.num_waiting) == (0, 0)


def test_transfer_reuses_locally_cached_blocks_then_decodes() -> None:
    s = make_scheduler()
    s.add_request(make_request("local", prompt_len=5, max_tokens=1))
    run_step(s)
    s.finish(s.requests["local"], RequestStatus.FINISHED_LENGTH)  # block 0 cached
    incoming = make_request("t1", prompt_len=10)  # shares the first block with "local"
    reserved = s.reserve_transfer("t1", incoming.prompt_token_ids, incoming.block_hashes, b"")
    assert (reserved.block_ids, reserved.num_cached_blocks) == ((0, 2, 3), 1)
    assert s.num_transfer_blocks() == 3
    incoming.append_output(55, None)
    s.add_transferred(incoming)
    assert chunk_view(run_step(s)) == [("t1", 10, 1, (0, 2, 3), True)]
    assert s.block_pool.match_prefix(incoming.block_hashes) == [0, 2]  # prompt blocks cached


def test_free_transfer_gives_the_blocks_back_and_shortage_raises() -> None:
    s = make_scheduler(num_blocks=2)
    r = make_request("t1", prompt_len=8)
    s.reserve_transfer("t1", r.prompt_token_ids, r.block_hashes, b"")
    assert s.block_pool.num_free == 0
    other = make_request("t2", prompt_len=3, first_token=300)
    assert not s.can_reserve_transfer(3, other.block_hashes)
    with pytest.raises(NoFreeBlocksError):
        s.reserve_transfer("t2", other.prompt_token_ids, other.block_hashes, b"")
    s.free_transfer("t1")
    assert s.block_pool.num_free == 2 and s.transferring == {}


def test_transfer_with_wrong_hash_count_is_refused() -> None:
    s = make_scheduler()
    r = make_request("t1", prompt_len=8)
    with pytest.raises(ValueError, match=r"^block_hashes: expected 2"):
        s.reserve_transfer("t1", r.prompt_token_ids, r.block_hashes[:1], b"")


def test_duplicate_request_id_is_refused() -> None:
    s = make_scheduler()
    s.add_request(make_request("r1"))
    with pytest.raises(ValueError, match=r"^request_id: 'r1' is already in use"):
        s.add_request(make_request("r1"))


# ---- overlap scheduling: samples in flight --------------------------------------------------


def test_a_token_still_being_sampled_is_decoded_from_a_placeholder() -> None:
    s = make_scheduler()
    r = make_request("r1", prompt_len=6)
    s.add_request(r)
    assert chunk_view(s.schedule()) == [("r1", 0, 6, (0, 1), True)]
    assert r.num_output_placeholders == 1 and s.has_ready_work()
    out = s.schedule()  # the first token is not read yet: its decode takes a placeholder
    [c] = out.batch.chunks
    assert (c.start_pos, c.token_ids, c.sample, c.placeholder) == (6, (0,), True, True)
    assert r.num_output_placeholders == 2 and r.num_computed_tokens == 7
    r.append_output(7, None)  # the first step is read
    assert r.num_output_placeholders == 1 and r.num_pending_tokens == 1
    [c] = s.schedule().batch.chunks  # position 7: still a placeholder (the second token)
    assert (c.start_pos, c.placeholder) == (7, True)
    r.append_output(8, None)
    r.append_output(9, None)
    [c] = s.schedule().batch.chunks  # everything read: a known token again
    assert (c.start_pos, c.token_ids, c.placeholder) == (8, (9,), False)


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len", "prefill_only"], ids=lambda x: x)
def test_a_sample_that_certainly_ends_the_request_gets_nothing_scheduled_after_it(
    limit: str,
) -> None:
    s = make_scheduler()
    if limit == "max_model_len":
        s.max_model_len = 8  # prompt 6 + 2 outputs
    if limit == "prefill_only":
        s.finish_after_first_token = True
    r = make_request("r1", prompt_len=6, max_tokens=2 if limit == "max_tokens" else 16)
    s.add_request(r)
    s.schedule()
    if limit != "prefill_only":
        assert [c.placeholder for c in s.schedule().batch.chunks] == [True]  # output 2 of 2
    assert chunk_view(s.schedule()) == []
    assert not s.has_ready_work()
    s.add_request(make_request("r2", prompt_len=3, first_token=200))
    assert s.has_ready_work()
    assert [c.request_id for c in s.schedule().batch.chunks] == ["r2"]


def test_a_request_finishing_in_flight_is_never_preempted() -> None:
    s = make_scheduler(num_blocks=4)
    r1 = make_request("r1", prompt_len=8)
    last = make_request("last", prompt_len=8, first_token=200, max_tokens=1)
    s.add_request(r1)
    s.add_request(last)
    s.schedule()  # both prompts; both first tokens in flight, the pool is full
    # r1's decode at position 8 needs a block. "last" is the newest, but its token in flight
    # ends it (max_tokens=1) and its blocks come back then: r1 preempts itself instead.
    out = s.schedule()
    assert out.preempted == ("r1",) and chunk_view(out) == []
    assert last.block_ids == [2, 3] and s.running == [last]
    r1.append_output(7, None)  # the step is read: r1's token joins it while it waits
    assert r1.output_token_ids == [7] and r1.num_output_placeholders == 0
    last.append_output(5, None)
    s.finish(last, RequestStatus.FINISHED_LENGTH)
    [c] = s.schedule().batch.chunks  # recomputed, its token 7 included
    assert (c.request_id, c.start_pos, c.token_ids[-1], c.sample) == ("r1", 0, 7, True)


def test_a_placeholder_request_too_big_for_the_pool_waits_for_its_token() -> None:
    s = make_scheduler(num_blocks=2)
    r = make_request("r1", prompt_len=7)
    s.add_request(r)
    s.schedule()
    r.append_output(7, None)
    s.schedule()  # decode at position 7 (the last slot of block 1), its token in flight
    out = s.schedule()  # position 8 needs a third block: wait for the token, do not finish
    assert (out.finished, chunk_view(out)) == ((), []) and r.status is RequestStatus.RUNNING
    r.append_output(8, None)
    out = s.schedule()  # the token did not stop it: now it ends as without overlap
    assert out.finished == (r,) and r.status is RequestStatus.FINISHED_LENGTH
    assert s.block_pool.num_free == 2
