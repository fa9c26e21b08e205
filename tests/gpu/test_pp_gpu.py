"""Pipeline parallelism on two GPUs over NCCL (run on the GPU machine; skipped with fewer than
two GPUs): PP=2 greedy tokens equal one rank's (tiny model, float32, torch attention; 2 and 4
stages over 2 GPUs is PP=2 only: a rank a device), and a PP=2 prefill and decode of a bf16
dummy model on flashinfer give the logits of a whole model of the same weights (to bf16
rounding: a micro-batch's GEMMs are of other shapes than the whole batch's).

Not yet run: the session that wrote it was lent no 2-GPU machine; the same scenarios run on
CPU over gloo in tests/integration/engine/test_engine_pp.py.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from pp_ranks import PPRanks
from tp_ranks import Scenario, decode_logits_vs_whole, generate_rounds

from deploy.checkpoints.make_model import make_model
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="pipeline parallelism over NCCL needs 2 GPUs (one a stage)",
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
    ranks = PPRanks(2, config, scenario, backend="nccl")
    try:
        results = ranks.start().results(timeout_s=300)
    finally:
        ranks.stop()
    assert all(status == "ok" for status, _ in results), results
    return results[0][1][0]


def test_pp2_nccl_greedy_tokens_equal_one_rank(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    config = EngineConfig(
        model_dir=str(tiny_model_dir), device="cuda", dtype="float32", attention_backend="torch",
        num_kv_blocks=256, max_num_batched_tokens=32, pipeline_parallel_size=2,
    )  # fmt: skip
    got = run_ranks(config, functools.partial(generate_rounds, prompts, GREEDY, 2))
    one = LLMEngine(replace(config, pipeline_parallel_size=1))
    want = generate_rounds(prompts, GREEDY, 2, one, None)
    assert got["rounds"] == want["rounds"]


def test_pp2_flashinfer_bf16_logits_match_a_whole_model(tmp_path: Path) -> None:
    model_dir = make_model(
        tmp_path / "toy", preset="llama3-8b", config_only=True, num_layers=4, hidden_size=256,
        intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1000,
    )  # fmt: skip
    config = EngineConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        attention_backend="flashinfer", max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
        pipeline_parallel_size=2, pipeline_micro_batches=2,
    )  # fmt: skip
    got = run_ranks(config, decode_logits_vs_whole)
    assert got["replays"] == 0  # a stage runs eager
    for diff, scale in zip(got["max_diff"], got["max_logit"], strict=True):
        assert diff <= 0.03 * scale + 1e-3, (diff, scale)
