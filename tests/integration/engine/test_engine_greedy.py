"""LLMEngine greedy outputs are token-identical to transformers (float32) through continuous
batching, chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import (
    greedy,
    make_engine,
    record_batches,
    run_to_completion,
    text_of,
    tokens_of,
)
from references import Reference

from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason
from vocabulary.tokenizer import Tokenizer


@pytest.fixture()
def engine_args(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer
) -> tuple[Path, LlamaModel, Tokenizer]:
    return tiny_model_dir, tiny_model, tokenizer


def add_all(engine, prompts: list[list[int]], max_tokens: int = 10) -> None:  # type: ignore[no-untyped-def]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))


def test_batch_of_mixed_prompts_matches_transformers(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*engine_args)
    add_all(engine, prompts)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 10), f"prompt {i}"
        assert outputs[f"r{i}"][-1].finish_reason is FinishReason.LENGTH
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_text_deltas_join_to_the_decoded_tokens(
    engine_args, prompts: list[list[int]], tokenizer: Tokenizer
) -> None:
    engine = make_engine(*engine_args)
    add_all(engine, prompts[:3], max_tokens=12)
    outputs = run_to_completion(engine)
    for i in range(3):
        assert text_of(outputs[f"r{i}"]) == tokenizer.decode(tokens_of(outputs[f"r{i}"]))


def test_chunked_prefill_under_a_small_budget_matches_transformers(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    # Budget 7 at block size 4: prompts advance 1-7 tokens a step, chunks end mid-block and
    # share steps with other requests' decodes.
    engine = make_engine(*engine_args, block_size=4, max_num_batched_tokens=7)
    batches = record_batches(engine)
    add_all(engine, prompts)
    outputs = run_to_completion(engine)
    assert all(b.num_tokens <= 7 for b in batches)
    mixed = [b for b in batches if not b.chunks[0].sample and b.chunks[-1].num_tokens == 1]
    assert mixed, "no step mixed a partial prefill chunk with decodes"
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 10), f"prompt {i}"


def test_prefix_cache_hit_reuses_blocks_and_gives_the_same_tokens(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*engine_args)
    first, extended = prompts[0], prompts[2]  # extended shares first's full blocks
    assert len(first) // 16 == 2 and extended[:32] == first[:32]
    engine.add_request("a", first, greedy())
    a = run_to_completion(engine)["a"]
    engine.add_request("again", first, greedy())
    engine.add_request("b", extended, greedy())
    outputs = run_to_completion(engine)
    assert a[-1].num_cached_prompt_tokens == 0
    # Same prompt: both of its full blocks are cached, but at most len - 1 tokens are reused.
    assert outputs["again"][-1].num_cached_prompt_tokens == 16 * ((len(first) - 1) // 16)
    assert outputs["b"][-1].num_cached_prompt_tokens == 32
    assert tokens_of(a) == tokens_of(outputs["again"]) == hf_greedy(first, 10)
    assert tokens_of(outputs["b"]) == hf_greedy(extended, 10)
    load = engine.load()
    assert load.num_cache_hit_tokens == 16 * ((len(first) - 1) // 16) + 32


def test_preemption_in_a_tiny_pool_still_matches_transformers(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    # 24 blocks of 4 tokens (96 slots) for 8 requests needing 315 in all (up to 70 each).
    engine = make_engine(*engine_args, block_size=4, num_kv_blocks=24)
    add_all(engine, prompts, max_tokens=12)
    outputs = run_to_completion(engine)
    assert engine.load().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 12), f"prompt {i}"
    assert engine.block_pool.num_free == 24


def test_chunked_prefill_disabled_matches_transformers(
    engine_args, prompts: list[list[int]], hf_greedy: Reference
) -> None:
    engine = make_engine(*engine_args, enable_chunked_prefill=False, max_num_batched_tokens=96)
    add_all(engine, prompts)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == hf_greedy(prompt, 10), f"prompt {i}"


def test_logprobs_of_greedy_tokens_are_the_max_log_probability(
    engine_args, prompts: list[list[int]], tiny_model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    engine = make_engine(*engine_args)
    engine.add_request("r", prompts[3], greedy(4, logprobs=True))
    outputs = run_to_completion(engine)["r"]
    got = [lp for out in outputs for lp in (out.logprobs or ())]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = prompts[3] + tokens_of(outputs)
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(prompts[3])
    want = [logp[n - 1 + k, ids[n + k]].item() for k in range(4)]
    assert got == pytest.approx(want, abs=1e-4)


def test_cache_salt_isolates_prefix_cache_entries(engine_args, prompts: list[list[int]]) -> None:
    engine = make_engine(*engine_args)
    engine.add_request("a", prompts[0], greedy(2), cache_salt="tenant-a")
    run_to_completion(engine)
    engine.add_request("b", prompts[0], greedy(2), cache_salt="tenant-b")
    engine.add_request("a2", prompts[0], greedy(2), cache_salt="tenant-a")
    outputs = run_to_completion(engine)
    assert outputs["b"][-1].num_cached_prompt_tokens == 0
    assert outputs["a2"][-1].num_cached_prompt_tokens == 32


def test_timings_and_load_snapshot(engine_args, prompts: list[list[int]]) -> None:
    engine = make_engine(*engine_args, max_num_batched_tokens=32)
    for i in (0, 1):
        engine.add_request(f"r{i}", prompts[i], greedy(3))
    load = engine.load()
    assert (load.num_waiting, load.num_running) == (2, 0)
    assert load.num_waiting_prefill_tokens == len(prompts[0]) + len(prompts[1])
    engine.step()  # 32 tokens of r0's prompt
    load = engine.load()
    assert (load.num_waiting, load.num_running) == (1, 1)
    assert load.num_waiting_prefill_tokens == len(prompts[0]) - 32 + len(prompts[1])
    assert load.num_free_blocks == load.num_total_blocks - 2
    outputs = run_to_completion(engine)
    t = outputs["r0"][-1].timings
    assert t.first_scheduled is not None and t.first_token is not None
    assert t.finished is not None
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert [o.timings.finished is None for o in outputs["r0"]] == [True, True, False]


def test_invalid_prompts_name_the_field(engine_args) -> None:
    engine = make_engine(*engine_args, num_kv_blocks=2)
    with pytest.raises(ValueError, match=r"^prompt_token_ids: must not be empty"):
        engine.add_request("r", [], greedy())
    with pytest.raises(ValueError, match=r"^prompt_token_ids: id 512 is outside \[0, 512\)"):
        engine.add_request("r", [0, 512], greedy())
    with pytest.raises(ValueError, match=r"^prompt_token_ids: 40 tokens do not fit the KV pool"):
        engine.add_request("r", [5] * 40, greedy())
    assert not engine.has_unfinished()
