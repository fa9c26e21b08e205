"""Tensor parallelism on two GPUs over NCCL (run on the GPU machine; skipped with fewer than
two GPUs): TP=2 greedy tokens equal one rank's (tiny model, float32, torch attention), and a
TP=2 decode step replayed from a CUDA graph with the all-reduces inside gives the logits of a
whole model of the same dummy weights (bf16, flashinfer).

Not yet run: the session that wrote it was lent no 2-GPU machine. What did run, on one H200
(two and four ranks sharing it over gloo with CUDA tensors, torch attention, no graphs): the
tiny model's greedy tokens equal one rank's.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_ranks import Scenario, TPRanks, decode_logits_vs_whole, generate_rounds

from deploy.checkpoints.make_model import make_model
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [
    "The river runs past the old mill and under the stone bridge. In the morning the water is cold",
    "The river runs past the old mill and under the stone bridge. In the morning the water is warm",
    "The baker opens his shop before the sun is up.",
    "Hello",
]


def run_ranks(config: EngineConfig, scenario: Scenario) -> Any:
    ranks = TPRanks(2, config, scenario, backend="nccl")
    try:
        results = ranks.start().results(timeout_s=300)
    finally:
        ranks.stop()
    assert all(status == "ok" for status, _ in results), results
    return results[0][1]


def test_tp2_nccl_greedy_tokens_equal_one_rank(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    config = EngineConfig(
        model_dir=str(tiny_model_dir), device="cuda", dtype="float32", attention_backend="torch",
        num_kv_blocks=256, max_num_batched_tokens=32, tensor_parallel_size=2,
    )  # fmt: skip
    got = run_ranks(config, functools.partial(generate_rounds, prompts, GREEDY, 2))
    one = LLMEngine(replace(config, tensor_parallel_size=1))
    want = generate_rounds(prompts, GREEDY, 2, one, None)
    assert got["rounds"] == want["rounds"]


def test_tp2_cuda_graph_decode_with_all_reduces_matches_a_whole_model(tmp_path: Path) -> None:
    """head_dim 64 (flashinfer attention, CUDA graphs), random bf16 weights: TP sums in
    another order, so logits agree to bf16 rounding, not bit for bit."""
    model_dir = make_model(
        tmp_path / "toy", preset="llama3-8b", config_only=True, num_layers=2, hidden_size=256,
        intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1000,
    )  # fmt: skip
    config = EngineConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        attention_backend="flashinfer", cuda_graph_max_batch=8, max_num_seqs=8,
        max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2,
    )  # fmt: skip
    got = run_ranks(config, decode_logits_vs_whole)
    assert got["replays"] == 1
    for diff, scale in zip(got["max_diff"], got["max_logit"], strict=True):
        assert diff <= 0.03 * scale + 1e-3, (diff, scale)
