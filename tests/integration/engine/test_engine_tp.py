"""Tensor parallelism on CPU: a TP engine of 2 (and 4) real processes over gloo gives the
greedy tokens of one rank, and a rank that dies or fails mid-step fails rank 0's step at once
(no hang).

Dense tokens are compared exactly: the tiny model's greedy choices have clear margins (it is
sharpened, deploy/checkpoints/make_model.py), and the ranks' partial sums in float32 move the logits
by
~1e-6, far below them; no near-tie flipped. FP8 weights are quantized per rank's part (one
scale per part, not per whole tensor), so there a token may flip: the margin rule of
tests/fp8_reference.py applies (a flip only where the logits of TP=2 and one rank differ by
more than half of one rank's top-2 gap).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cpu_engine import cpu_engine
from engine_factories import greedy
from fp8_reference import assert_flip_at_near_tie, first_difference
from tp_ranks import (
    TPRanks,
    fail_then_generate,
    generate_rounds,
    generate_then_teacher_force,
    step_after_kill,
    step_until_error,
    teacher_forced,
)

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel
from vocabulary.tokenizer import Tokenizer


def tp_config(model_dir: Path, size: int, **fields: Any) -> EngineConfig:
    """Chunked prefill (32-token steps: the long prompts take 2 chunks), 128 blocks."""
    return cpu_engine(
        model_dir, block_size=16, num_kv_blocks=128, max_num_batched_tokens=32,
        tensor_parallel_size=size, tp_timeout_s=20.0, **fields,
    )  # fmt: skip


def one_rank_rounds(
    config: EngineConfig, model: LlamaModel, tokenizer: Tokenizer, prompts: list[list[int]]
) -> dict[str, Any]:
    engine = LLMEngine(replace(config, tensor_parallel_size=1), model=model, tokenizer=tokenizer)
    return generate_rounds(prompts, greedy(10), 2, engine, None)


@pytest.mark.parametrize("size", [2, 4])
def test_tp_greedy_tokens_equal_one_rank(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    size: int,
) -> None:
    """Eight prompts in one batch, chunked, twice (the second round hits the prefix cache);
    size 4 > the tiny model's 2 KV heads: each rank holds one replicated KV head."""
    config = tp_config(tiny_model_dir, size)
    ranks = TPRanks(size, config, functools.partial(generate_rounds, prompts, greedy(10), 2))
    try:
        results = ranks.start().results(timeout_s=90)
    finally:
        ranks.stop()
    assert all(status == "ok" for status, _ in results), results
    got = results[0][1]
    want = one_rank_rounds(config, tiny_model, tokenizer, prompts)
    assert got["rounds"] == want["rounds"]
    cached = [c for _, c in got["rounds"][1]]
    assert sum(cached) > 0 and cached[0] == 32  # the 2-block shared prefix
    spec = got["spec"]
    assert (spec.tp_size, spec.tp_rank, spec.num_kv_heads) == (size, 0, 2 // min(size, 2))
    assert all(steps > 0 for _, steps in results[1:])  # followers ran and returned on close


def test_killed_follower_fails_rank0_next_step_within_deadline(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    config = tp_config(tiny_model_dir, 2)
    scenario = functools.partial(step_after_kill, prompts[0], greedy(50))
    ranks = TPRanks(2, config, scenario).start()
    try:
        assert ranks.recv(0, timeout_s=60) == "ready"
        ranks.kill(1)
        ranks.pipes[0].send("killed")
        ((status, (elapsed, error, message)),) = ranks.results(timeout_s=30, ranks=(0,))
    finally:
        ranks.stop()
    assert status == "ok"
    assert error == "TPGroupError", message
    assert "TP group broken" in message
    assert elapsed < config.tp_timeout_s


def test_follower_failing_mid_forward_fails_every_rank(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """Rank 1 raises between a layer's two all-reduces in its 6th step: it breaks the group
    at once, so rank 0 (waiting in the next all-reduce) fails too, well within the deadline."""
    config = tp_config(tiny_model_dir, 2)
    num_layers = 4
    scenario = functools.partial(step_until_error, prompts[0], greedy(50))
    ranks = TPRanks(2, config, scenario, fault=("mlp", 5 * num_layers + 1))
    try:
        leader, follower = ranks.start().results(timeout_s=60)
    finally:
        ranks.stop()
    status, (elapsed, error, message) = leader
    assert status == "ok"
    assert error == "TPGroupError", message
    assert elapsed < config.tp_timeout_s
    assert follower[0] == "error" and "failed between all-reduces" in follower[1]
    assert "injected fault" in follower[1]


def test_follower_failing_after_its_last_all_reduce_fails_the_step_on_every_rank(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
) -> None:
    """Rank 1's head raises in its 3rd step: the ranks agree that the step failed, rank 0's
    step raises TPStepError naming rank 1's error, and the group serves on."""
    config = tp_config(tiny_model_dir, 2)
    scenario = functools.partial(fail_then_generate, prompts[3], greedy(8))
    ranks = TPRanks(2, config, scenario, fault=("logits", 3))
    try:
        leader, follower = ranks.start().results(timeout_s=60)
    finally:
        ranks.stop()
    assert leader[0] == "ok", leader
    (_, error, message), tokens = leader[1]
    assert error == "TPStepError"
    assert "failed on TP rank 1: RuntimeError: injected fault in compute_logits" in message
    one = LLMEngine(replace(config, tensor_parallel_size=1), model=tiny_model, tokenizer=tokenizer)
    assert tokens == one.generate([prompts[3]], greedy(8))[0]
    assert follower[0] == "ok"


def test_tp_fp8_weights_and_kv_follow_one_rank_under_the_margin_rule(
    tiny_model_dir: Path, tokenizer: Tokenizer, prompts: list[list[int]]
) -> None:
    """--quantization fp8 from the float32 checkpoint and an e4m3 KV pool at TP=2: the ranks
    agree on the calibration's max, so the KV scales are one rank's exactly."""
    config = tp_config(tiny_model_dir, 2, quantization="fp8", kv_cache_dtype="fp8")
    texts = prompts[:6]
    scenario = functools.partial(generate_then_teacher_force, texts, greedy(16))
    one = LLMEngine(replace(config, tensor_parallel_size=1), tokenizer=tokenizer)
    want = [t for t, _ in generate_rounds(texts, greedy(16), 1, one, None)["rounds"][0]]
    ranks = TPRanks(2, config, scenario).start()
    try:
        tokens = [t for t, _ in ranks.recv(0, timeout_s=60)]
        pairs = enumerate(zip(want, tokens, strict=True))
        differ = {i: first_difference(w, g) for i, (w, g) in pairs}
        flips = {i: t for i, t in differ.items() if t is not None}
        seqs = [texts[i] + want[i][:t] for i, t in flips.items()]
        ranks.pipes[0].send(seqs)
        (status, (logits, scales)), _ = ranks.results(timeout_s=60)
    finally:
        ranks.stop()
    assert status == "ok"
    assert scales == one.kv_cache.spec.scales
    assert len(flips) <= len(texts) // 2, flips
    for (i, t), seq, have in zip(flips.items(), seqs, logits, strict=True):
        assert_flip_at_near_tie(teacher_forced(one, seq), have, f"prompt {i}, token {t}")
