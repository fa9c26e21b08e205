"""A split engine (EngineMode.SPLIT: a prefill loop and a decode loop over one KV pool) gives
transformers' greedy tokens, hands prompts to its decode loop by a change of block ownership,
keeps its decode loop room to grow at pool exhaustion, and frees everything at the end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import Reference
from step_faults import fail_first_execute

from engine.config import EngineMode
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason
from vocabulary.tokenizer import Tokenizer


@pytest.fixture()
def split_args(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> tuple[Path, LlamaModel, Tokenizer, EngineMode]:
    return tiny_model_dir, tiny_model, tokenizer, EngineMode.SPLIT


def test_split_engine_greedy_tokens_match_transformers(
    split_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*split_args)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(10))
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 10), f"prompt {i}"
        assert outputs[f"r{i}"][-1].finish_reason is FinishReason.LENGTH
    lane = engine.prefill_lane
    assert lane is not None and lane.num_handoffs == len(prompts)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_prompt_is_prefilled_by_the_lane_and_its_blocks_change_owner_uncopied(
    split_args, prompts: list[list[int]]
) -> None:
    engine = make_engine(*split_args, max_num_batched_tokens=16)  # a 58-token prompt: 4 chunks
    lane = engine.prefill_lane
    assert lane is not None
    engine.add_request("long", prompts[2], greedy(4))
    assert len(prompts[2]) == 58
    steps, outputs = 0, []
    while "long" in lane.scheduler.requests:
        assert not engine.scheduler.requests  # the decode loop has nothing until the hand-off
        outputs += engine.step()
        steps += 1
    assert steps == 4  # chunks of 16, 16, 16 and 10 tokens, the last one sampling
    assert [len(o.new_token_ids) for o in outputs] == [1]  # the first token, at the hand-off
    request = engine.scheduler.requests["long"]
    held = list(request.block_ids)
    free_before = engine.block_pool.num_free
    engine.step()  # the decode loop's first step on it
    assert request.block_ids[: len(held)] == held  # the same blocks, no copy
    assert engine.block_pool.num_free >= free_before - 1  # at most the block it grows into
    status = engine.load().split
    assert status is not None and status.handoffs == 1 and not status.partitioned
    assert status.reason.startswith("no CUDA device")


def test_the_prefill_loop_leaves_the_decode_loop_room_at_pool_exhaustion(
    split_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    # 40 blocks of 4 tokens: four decodes of the 2-block prompts grow one block each 4 tokens,
    # while long prompts keep arriving; the lane may only take what leaves a block per running
    # decode plus a headroom of 2.
    engine = make_engine(
        *split_args, block_size=4, num_kv_blocks=40, split_decode_headroom_blocks=2
    )
    short = [p for p in prompts if len(p) <= 8][:4]
    outputs: dict[str, list] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    for i, prompt in enumerate(short):
        engine.add_request(f"d{i}", prompt, greedy(24))
    while len(engine.scheduler.running) < len(short):
        step()
    lane = engine.prefill_lane
    assert lane is not None
    engine.add_request("big0", prompts[2], greedy(8))
    engine.add_request("big1", prompts[0], greedy(8))
    for _ in range(400):
        if not engine.has_unfinished():
            break
        running = len(engine.scheduler.running)
        lane_blocks = sum(len(r.block_ids) for r in lane.scheduler.running)
        before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        step()
        # the rule: after the lane took blocks, the pool kept one free per running decode
        # plus the headroom (or the lane holds nothing)
        lane_after = sum(len(r.block_ids) for r in lane.scheduler.running)
        if lane_after > lane_blocks:
            assert engine.block_pool.num_free >= running + 2
        # the decode loop never waits on the lane: each running decode advanced one token
        for r in engine.scheduler.running:
            if r.request_id in before:
                assert r.num_computed_tokens == before[r.request_id] + 1
    assert not engine.has_unfinished()
    for i, prompt in enumerate(short):
        assert tokens_of(outputs[f"d{i}"]) == hf_greedy(prompt, 24), f"decode {i}"
    assert tokens_of(outputs["big0"]) == hf_greedy(prompts[2], 8)
    assert tokens_of(outputs["big1"]) == hf_greedy(prompts[0], 8)
    assert engine.block_pool.num_free == 40


def test_lane_admission_waits_for_the_reserve_and_decodes_go_on(
    split_args, prompts: list[list[int]]
) -> None:
    engine = make_engine(
        *split_args, block_size=4, num_kv_blocks=24, split_decode_headroom_blocks=4
    )
    lane = engine.prefill_lane
    assert lane is not None
    for i in range(3):
        engine.add_request(f"d{i}", prompts[5 + (i % 2)], greedy(30))
    while len(engine.scheduler.running) < 3:
        engine.step()
    # A 58-token prompt needs 15 blocks: with 3 running decodes + 4 headroom it must wait
    # whenever fewer than 15 + 7 blocks are free.
    engine.add_request("big", prompts[2], greedy(2))
    steps_waited = 0
    for _ in range(200):
        decoded_before = {r.request_id: r.num_output_tokens for r in engine.scheduler.running}
        free, running = engine.block_pool.num_free, len(engine.scheduler.running)
        head = lane.scheduler.waiting[0].request_id if lane.scheduler.waiting else None
        engine.step()  # the lane decides first, on the state read just above
        if head == "big" and "big" in lane.scheduler.requests and not lane.scheduler.running:
            steps_waited += 1
            assert free < 15 + running + 4  # it waits only for the rule
        for r in engine.scheduler.running:  # decodes were never held up by the lane
            if r.request_id in decoded_before:
                assert r.num_output_tokens == decoded_before[r.request_id] + 1
        if not engine.has_unfinished():
            break
    assert steps_waited > 0
    assert not engine.has_unfinished() and engine.block_pool.num_free == 24


def test_abort_in_the_lane_and_in_the_decode_loop_frees_every_block(
    split_args, prompts: list[list[int]]
) -> None:
    engine = make_engine(*split_args, max_num_batched_tokens=16)
    engine.add_request("decoding", prompts[5], greedy(50))
    while "decoding" not in engine.scheduler.requests:
        engine.step()
    engine.add_request("prefilling", prompts[2], greedy(8))
    engine.step()
    lane = engine.prefill_lane
    assert lane is not None and "prefilling" in lane.scheduler.requests
    assert "decoding" in engine.scheduler.requests
    assert engine.abort_request("prefilling") and engine.abort_request("decoding")
    assert not engine.abort_request("prefilling")
    run_to_completion(engine)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_first_token_that_ends_the_request_finishes_it_in_the_lane(
    split_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*split_args)
    engine.add_request("one", prompts[0], greedy(1))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["one"]) == hf_greedy(prompts[0], 1)
    assert outputs["one"][-1].finish_reason is FinishReason.LENGTH
    lane = engine.prefill_lane
    assert lane is not None and lane.num_handoffs == 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_failed_prefill_step_aborts_the_lane_s_requests_and_the_worker_goes_on(
    split_args, prompts: list[list[int]], hf_greedy: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineDriver's recovery from a step that raises aborts the requests of both loops
    (those in the lane were left waiting before) and frees their blocks."""
    from engine.core.driver import EngineDriver

    engine = make_engine(*split_args)
    lane = engine.prefill_lane
    assert lane is not None
    fail_first_execute(monkeypatch, lane.runner, "injected prefill step failure")
    done: dict[str, list[int]] = {}
    failed: list[list[str]] = []

    def on_outputs(outs) -> None:  # type: ignore[no-untyped-def]
        for out in outs:
            done.setdefault(out.request_id, []).extend(out.new_token_ids)

    driver = EngineDriver(engine, on_outputs, on_step_error=lambda e, ids: failed.append(ids))
    driver.start()
    try:
        driver.call(lambda e: e.add_request("doomed", prompts[0], greedy(8))).result(timeout=10)
        deadline = time.monotonic() + 10
        while failed != [["doomed"]]:
            assert time.monotonic() < deadline, f"no abort of the lane's request: {failed}"
            time.sleep(0.01)
        driver.call(lambda e: e.add_request("after", prompts[1], greedy(8))).result(timeout=10)
        while len(done.get("after", [])) < 8:
            assert time.monotonic() < deadline + 10, "the request after the failure never ended"
            time.sleep(0.01)
        idle = driver.call(lambda e: not e.has_unfinished()).result(timeout=10)
    finally:
        driver.stop()
    assert done["after"] == hf_greedy(prompts[1], 8) and idle
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
