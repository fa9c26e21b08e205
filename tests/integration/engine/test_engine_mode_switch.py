"""An idle engine changes its mode in place (engine/core/mode_switch.py): after each switch it
serves as the new mode does (greedy tokens equal transformers'), keeps its pool and the
prefix blocks it cached, and a busy engine refuses with nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from references import Reference

from engine.config import EngineMode
from engine.core.mode_switch import EngineBusy, set_mode
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import FinishReason
from vocabulary.tokenizer import Tokenizer


def test_prefill_only_to_colocated_to_split_and_back_serves_each_mode(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    hf_greedy: Reference,
) -> None:
    engine = make_engine(tiny_model_dir, tiny_model, tokenizer, EngineMode.PREFILL_ONLY)
    engine.add_request("p", prompts[0], greedy(8))
    (out,) = run_to_completion(engine)["p"]
    assert out.finish_reason is FinishReason.HANDOFF and out.kv_handoff is not None
    engine.release_request_blocks("p")
    cached = engine.load().num_cache_hit_tokens

    set_mode(engine, EngineMode.COLOCATED)
    engine.add_request("c", prompts[0], greedy(8))
    outs = run_to_completion(engine)["c"]
    assert tokens_of(outs) == hf_greedy(prompts[0], 8)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    # the prompt's full blocks, cached while prefill-only, were reused after the switch
    assert engine.load().num_cache_hit_tokens - cached == len(prompts[0]) // 16 * 16

    set_mode(engine, EngineMode.SPLIT)
    assert engine.prefill_lane is not None
    engine.add_request("s", prompts[1], greedy(8))
    assert tokens_of(run_to_completion(engine)["s"]) == hf_greedy(prompts[1], 8)
    assert engine.prefill_lane.num_handoffs == 1

    set_mode(engine, EngineMode.PREFILL_ONLY)
    assert engine.prefill_lane is None and engine.load().split is None
    engine.add_request("p2", prompts[1], greedy(8))
    (out,) = run_to_completion(engine)["p2"]
    assert out.finish_reason is FinishReason.HANDOFF
    engine.release_request_blocks("p2")
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_busy_engine_refuses_to_switch_and_stays_as_it_was(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    engine = make_engine(tiny_model_dir, tiny_model, tokenizer, EngineMode.PREFILL_ONLY)
    engine.add_request("held", prompts[0], greedy(4))
    run_to_completion(engine)  # its blocks stay held for the hand-off
    with pytest.raises(EngineBusy, match="1 hand-offs"):
        set_mode(engine, EngineMode.COLOCATED)
    assert engine.config.mode is EngineMode.PREFILL_ONLY
    assert engine.scheduler.finish_after_first_token
    engine.release_request_blocks("held")
    engine.add_request("running", prompts[1], greedy(4))
    with pytest.raises(EngineBusy, match="1 unfinished requests"):
        set_mode(engine, EngineMode.SPLIT)
    assert engine.prefill_lane is None
    run_to_completion(engine)
    engine.release_request_blocks("running")
    set_mode(engine, EngineMode.COLOCATED)
    assert engine.config.mode is EngineMode.COLOCATED
