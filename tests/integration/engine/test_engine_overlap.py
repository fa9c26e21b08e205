"""Overlap scheduling keeps the engine exact: placeholder decodes give transformers' tokens,
a request that stops or is aborted with its next decode in flight emits nothing more and
gives every block back, preemption and prefill-only hand-off work under it, and seeded
sampling (penalties included) is the same with overlap on or off and whatever the batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from engine_factories import greedy, make_engine, record_batches, run_to_completion, tokens_of
from references import Reference

from engine.batch import ScheduledBatch
from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.core.overlap import InflightStep
from engine.modeling.llama import LlamaModel
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.engine_io import FinishReason, RequestOutput
from vocabulary.numeric import cdiv
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

EOS = 1


@pytest.fixture()
def engine_args(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> tuple[Path, LlamaModel, Tokenizer]:
    return tiny_model_dir, tiny_model, tokenizer


def placeholder_decodes(batches: list[ScheduledBatch], request_id: str) -> list[int]:
    """Positions of `request_id`'s decodes whose input was still being sampled."""
    return [
        c.start_pos
        for b in batches
        for c in b.chunks
        if c.request_id == request_id and c.placeholder
    ]


def held_blocks(engine: LLMEngine) -> set[int]:
    return {b for r in engine.scheduler.requests.values() for b in r.block_ids}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_chunked_batches_are_token_exact_with_overlap_on_or_off(
    engine_args, prompts: list[list[int]], hf_greedy: Reference, overlap: bool
) -> None:
    # Budget 7 at block size 4: prompt chunks share steps with placeholder decodes.
    engine = make_engine(
        *engine_args, block_size=4, max_num_batched_tokens=7, overlap_scheduling=overlap
    )
    batches = record_batches(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(10))
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 10), f"prompt {i}"
    placeholders = [c for b in batches for c in b.chunks if c.placeholder]
    assert bool(placeholders) is overlap
    mixed = [
        b for b in batches if any(c.placeholder for c in b.chunks) and b.chunks[0].num_tokens > 1
    ]
    assert bool(mixed) is overlap, "no step mixed a prompt chunk with placeholder decodes"
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_outputs_arrive_one_step_late_with_overlap_and_at_once_without(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    want = hf_greedy(prompts[3], 3)
    on, off = make_engine(*engine_args), make_engine(*engine_args, overlap_scheduling=False)
    for engine in (on, off):
        engine.add_request("r", prompts[3], greedy(3))
        engine.add_request("other", prompts[4], greedy(6))
    per_step_on = [[o.new_token_ids for o in on.step() if o.request_id == "r"] for _ in range(4)]
    per_step_off = [[o.new_token_ids for o in off.step() if o.request_id == "r"] for _ in range(4)]
    assert per_step_off == [[(want[0],)], [(want[1],)], [(want[2],)], []]
    # Step 1 launches the prompts and reads nothing; each later step reads the one before.
    # The third token ends "r" (max_tokens): no decode of it is launched.
    assert per_step_on == [[], [(want[0],)], [(want[1],)], [(want[2],)]]


@pytest.mark.parametrize("how", ["eos", "stop_token", "stop_string"])
def test_a_request_that_stops_emits_nothing_after_and_frees_its_blocks(
    engine_args,
    prompts: list[list[int]],
    hf_greedy: Reference,
    tokenizer: Tokenizer,
    how: str,
) -> None:
    prompt = prompts[5]
    ref = hf_greedy(prompt, 16)
    if how == "eos":
        assert EOS in ref
        end, params = ref.index(EOS) + 1, greedy(16, ignore_eos=False)
    elif how == "stop_token":
        end, params = ref.index(ref[3]) + 1, greedy(16, stop_token_ids=(ref[3],))
    else:
        text = tokenizer.decode(ref)
        stop = text[4:7]
        end = next(k for k in range(1, 17) if stop in tokenizer.decode(ref[:k]))
        params = greedy(16, stop=(stop,))
    engine = make_engine(*engine_args, block_size=4, num_kv_blocks=64)
    batches = record_batches(engine)
    engine.add_request("stops", prompt, params)
    engine.add_request("goes-on", prompts[0], greedy(16))
    got: list[RequestOutput] = []
    after_finish: list[RequestOutput] = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        outs = [o for o in engine.step() if o.request_id == "stops"]
        if got and got[-1].finished:
            after_finish += outs
            continue
        got += outs
        if got and got[-1].finished:  # the step that read the stop: its blocks are back
            assert "stops" not in engine.scheduler.requests
            assert "goes-on" in engine.scheduler.requests
            in_use = engine.block_pool.num_blocks - engine.block_pool.num_free
            assert in_use == len(held_blocks(engine))
    assert tokens_of(got) == ref[:end]
    assert got[-1].finish_reason is FinishReason.STOP and after_finish == []
    # The decode of the stopping token was launched before that token was read: computed,
    # then discarded (never emitted, never decoded further).
    stop_position = len(prompt) + end - 1
    assert stop_position in placeholder_decodes(batches, "stops")
    assert max(placeholder_decodes(batches, "stops")) == stop_position
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_abort_with_a_step_in_flight_frees_every_block_and_emits_nothing(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*engine_args, block_size=4, max_num_batched_tokens=24, num_kv_blocks=96)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(12))
    emitted: dict[str, list[int]] = {}
    for _ in range(5):  # some decoding (with a placeholder in flight), some mid-prefill or waiting
        for out in engine.step():
            emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
    in_flight = [r.request_id for r in engine.scheduler.running if r.num_output_placeholders]
    assert in_flight and engine.scheduler.waiting
    # Abort one decoding request: it emits nothing more, the others stay exact.
    victim = in_flight[0]
    assert engine.abort_request(victim)
    victim_blocks = engine.block_pool.num_blocks - engine.block_pool.num_free
    assert victim_blocks == len(held_blocks(engine))  # its blocks are back at once
    rest = run_to_completion(engine)
    assert victim not in rest
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        if rid != victim:
            assert emitted.get(rid, []) + tokens_of(rest[rid]) == hf_greedy(prompt, 12), rid
    # Abort everything while a step is in flight: every block back, nothing emitted.
    for i, prompt in enumerate(prompts):
        engine.add_request(f"again{i}", prompt, greedy(12))
    for _ in range(4):
        engine.step()
    assert any(r.num_output_placeholders for r in engine.scheduler.running)
    for i in range(len(prompts)):
        assert engine.abort_request(f"again{i}")
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert not engine.has_unfinished() and engine.step() == []
    # The id is free again and the in-flight leftovers do not leak into the new request.
    engine.add_request("again0", prompts[0], greedy(12))
    assert tokens_of(run_to_completion(engine)["again0"]) == hf_greedy(prompts[0], 12)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_preemption_of_requests_with_a_token_in_flight_still_matches_transformers(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    # 24 blocks of 4 tokens (96 slots) for 8 requests needing up to 70 each.
    engine = make_engine(*engine_args, block_size=4, num_kv_blocks=24)
    schedule = engine.scheduler.schedule
    preempted_in_flight: list[str] = []

    def recording_schedule():  # type: ignore[no-untyped-def]
        decision = schedule()
        for rid in decision.preempted:
            request = next(r for r in engine.scheduler.waiting if r.request_id == rid)
            if request.num_output_placeholders:
                preempted_in_flight.append(rid)
        return decision

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(12))
    outputs = run_to_completion(engine)
    assert preempted_in_flight, "no request was preempted with its newest token in flight"
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 12), f"prompt {i}"
    assert engine.block_pool.num_free == 24


def test_prefill_only_finishes_on_its_first_token_and_never_decodes_under_overlap(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(
        *engine_args,
        mode=EngineMode.PREFILL_ONLY,
        enable_chunked_prefill=False,
        max_num_batched_tokens=len(prompts[2]) + 1,
    )
    batches = record_batches(engine)
    engine.add_request("a", prompts[2], greedy(2))  # whole prompts: one step each
    engine.add_request("b", prompts[0], greedy(2))
    assert engine.step() == []  # "a" in flight, "b" waits: nothing read yet
    # Launches "b", reads "a"; then nothing could run without "b"'s token: reads it at once.
    out_a, out_b = engine.step()
    assert not engine.has_unfinished()
    for out, prompt in ((out_a, prompts[2]), (out_b, prompts[0])):
        assert out.finish_reason is FinishReason.HANDOFF
        assert out.new_token_ids == (hf_greedy(prompt, 1)[0],)
        assert out.kv_handoff is not None and len(out.kv_handoff.block_ids) == -(-len(prompt) // 16)
    assert [c.request_id for b in batches for c in b.chunks] == ["a", "b"]
    assert engine.load().num_handoff_blocks == cdiv(len(prompts[2]), 16) + cdiv(len(prompts[0]), 16)
    assert engine.release_request_blocks("a") and engine.release_request_blocks("b")
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_transfer_reservation_waits_for_a_step_that_may_write_given_back_blocks(
    engine_args, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[int] = []
    monkeypatch.setattr(InflightStep, "wait_device", lambda self: waits.append(1))
    engine = make_engine(*engine_args, mode=EngineMode.DECODE_ONLY)
    engine.add_request("a", prompts[3], greedy(10))
    engine.add_request("b", prompts[4], greedy(10))
    engine.step()
    engine.step()  # a decode of each is in flight
    extra = hash_extra(engine.model_id)
    waits.clear()  # (reading a step waits too)
    engine.allocate_for_transfer("t1", prompts[0], hash_chain(prompts[0], 16, extra))
    assert waits == []  # nobody gave blocks back: no wait
    engine.abort_request("a")  # its blocks may still be written by the step in flight
    engine.allocate_for_transfer("t2", prompts[1], hash_chain(prompts[1], 16, extra))
    assert waits == [1]
    engine.free_transfer_blocks("t1")
    engine.free_transfer_blocks("t2")


PARAMS = SamplingParams(
    temperature=1.5, top_p=0.9, top_k=40, min_p=0.01, repetition_penalty=1.3,
    presence_penalty=0.4, frequency_penalty=0.3, max_tokens=14, ignore_eos=True, logprobs=True,
)  # fmt: skip


def test_seeded_sampling_is_the_same_with_overlap_on_or_off_and_whatever_the_batch(
    engine_args, prompts: list[list[int]]
) -> None:
    seeded = replace(PARAMS, seed=1234)

    def run(overlap: bool, crowd: bool) -> tuple[list[int], list[float]]:
        engine = make_engine(*engine_args, seed=7 if crowd else 0, overlap_scheduling=overlap)
        if crowd:
            engine.add_request("unseeded", prompts[0], PARAMS)
            engine.add_request("greedy", prompts[1], greedy(5, repetition_penalty=1.5))
            engine.add_request("other-seed", prompts[3], replace(PARAMS, seed=4321))
        engine.add_request("s", prompts[3], seeded)
        outputs = run_to_completion(engine)["s"]
        return tokens_of(outputs), [lp for o in outputs for lp in (o.logprobs or ())]

    alone_on, alone_off = run(True, False), run(False, False)
    crowd_on, crowd_off = run(True, True), run(False, True)
    assert alone_on == alone_off  # same batches: bit-identical tokens and log-probabilities
    assert crowd_on == crowd_off
    assert alone_on[0] == crowd_on[0]
    assert crowd_on[1] == pytest.approx(alone_on[1], abs=1e-4)
    assert len(alone_on[0]) == 14


def test_penalties_count_the_output_still_in_flight(
    engine_args, prompts: list[list[int]], tiny_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # Penalties below 1 / below 0 reward repeating what was seen: on a 4-token prompt,
    # whether the newest token (a placeholder on the host while its successor is sampled)
    # is counted decides the next one (checked: ignoring it gives other tokens).
    params = greedy(12, repetition_penalty=0.2, frequency_penalty=-2.0, presence_penalty=-0.5)
    prompt = prompts[5]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(ids[len(prompt) :], dtype=torch.long),
                                    minlength=logits.shape[0]).float()  # fmt: skip
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            rep = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - params.frequency_penalty * counts
            logits = logits - params.presence_penalty * (counts > 0).float()
            ids.append(int(logits.argmax()))
    want = ids[len(prompt) :]
    for overlap in (True, False):
        engine = make_engine(*engine_args, overlap_scheduling=overlap)
        engine.add_request("r", prompt, params)
        engine.add_request("other", prompts[0], greedy(12))  # keeps a batch of two going
        assert tokens_of(run_to_completion(engine)["r"]) == want, f"overlap={overlap}"
