"""FP8 weights and an FP8 KV cache on the tiny model (CPU: FP8 values, dequantized matmuls and
attention): greedy tokens equal the float32 engine's except at near-ties, by a stated margin
rule. Weights use the static activation scales calibrated at load
(engine/loading/fp8_calibration.py), the KV pool its calibrated per-layer scales.

Margin rule: tests/fp8_reference.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_factories import greedy, make_engine, run_to_completion, tokens_of
from fp8_reference import greedy_margin_check

from engine.modeling.llama import LlamaModel
from vocabulary.tokenizer import Tokenizer

MAX_TOKENS = 24


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("fp8", "auto"), ("none", "fp8"), ("fp8", "fp8")]
)
def test_fp8_matches_float32_greedy_but_at_near_ties(
    tiny_model_dir: Path, tiny_model: LlamaModel, tokenizer: Tokenizer,
    prompts: list[list[int]], quantization: str, kv_cache_dtype: str,
) -> None:  # fmt: skip
    fp8_model = copy.deepcopy(tiny_model)
    ref_engine = make_engine(tiny_model_dir, tiny_model, tokenizer)
    fp8_engine = make_engine(
        tiny_model_dir, fp8_model, tokenizer,
        quantization=quantization, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    kv_scales = fp8_engine.kv_cache.spec.scales
    if quantization == "fp8":
        assert fp8_model.weight_bytes < tiny_model.weight_bytes
    if kv_cache_dtype == "fp8":
        assert fp8_engine.kv_cache.tensor.dtype == torch.float8_e4m3fn and kv_scales
        assert fp8_engine.kv_cache.spec.block_nbytes * 4 == ref_engine.kv_cache.spec.block_nbytes
    seen = greedy_margin_check(ref_engine, fp8_engine, prompts, greedy(MAX_TOKENS))
    exact, first_flips = seen.exact, seen.first_flips
    # not vacuous: the tiny model's logits move by up to ~1 (of a spread of ~5) under
    # per-tensor FP8, so near-ties flip only some steps in; every continuation starts equal
    assert exact >= 1 and min(first_flips, default=MAX_TOKENS) >= 4, (exact, first_flips)


def test_quantizing_at_load_frees_the_dense_projection_weights(
    tiny_model_dir: Path, tokenizer: Tokenizer
) -> None:
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine

    config = EngineConfig(
        model_dir=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
        cuda_graphs=False, attention_backend="torch", quantization="fp8",
    )  # fmt: skip
    engine = LLMEngine(config, tokenizer=tokenizer)
    layer = engine.model.layers[0]
    assert engine.model.quantization == "fp8"
    assert layer.qkv_proj.numel() == 0 and layer.quantized is not None  # type: ignore[union-attr]
    assert layer.quantized["qkv_proj"].weight.dtype == torch.float8_e4m3fn  # type: ignore[index]
    engine.add_request("a", list(range(5, 30)), greedy(4))
    assert len(tokens_of(run_to_completion(engine)["a"])) == 4
