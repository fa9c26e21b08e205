"""`load_format=dummy` (engine/loading/dummy_weights.py): random weights from config.json alone, of
the config's shapes, seeded, with finite logits; with fp8 built straight into FP8 layers, equal to
quantizing the dense dummy model; an engine serves a config-only folder whose model vocabulary is
larger than its tokenizer's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from deploy.checkpoints.make_model import make_model
from engine.config import EngineConfig
from engine.loading.dummy_weights import INIT_STD, dummy_model
from engine.loading.hf_checkpoint import projection_shapes
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel, causal_attend
from engine.quantization.fp8_linear import FP8_DTYPE
from vocabulary.model_config import ModelConfig


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only folder: llama3-8b's recipe at a toy size, its vocabulary (1000) larger
    than the tokenizer's (512)."""
    out = tmp_path_factory.mktemp("dummy") / "toy"
    return make_model(
        out, preset="llama3-8b", config_only=True, num_layers=2, hidden_size=64,
        intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=1000,
    )  # fmt: skip


def logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    attend = causal_attend(1, len(ids), model.cfg.num_heads, model.cfg.num_kv_heads)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attend))


def test_dummy_weights_have_the_configs_shapes_a_sensible_scale_and_finite_logits(
    config_only: Path,
) -> None:
    assert not list(config_only.glob("*.safetensors"))
    model = load_model(config_only, torch.bfloat16, load_format="dummy")
    cfg = ModelConfig.from_pretrained(config_only)
    assert model.quantization == "none" and model.embed_tokens.shape == (1000, 64)
    layer = model.layers[1]
    for name, shape in projection_shapes(cfg).items():
        assert tuple(getattr(layer, name).shape) == shape
    assert float(layer.gate_up_proj.float().std()) == pytest.approx(INIT_STD, rel=0.05)
    assert bool((layer.input_layernorm.weight == 1).all())
    out = logits(model, list(range(1, 30)))
    assert out.shape == (29, 1000) and bool(out.isfinite().all()) and float(out.std()) > 0


def test_the_same_seed_gives_the_same_weights_another_seed_others(config_only: Path) -> None:
    cfg = ModelConfig.from_pretrained(config_only)
    a, b, c = (dummy_model(cfg, torch.float32, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.layers[0].qkv_proj, b.layers[0].qkv_proj)
    assert torch.equal(a.lm_head, b.lm_head)  # type: ignore[arg-type]
    assert not torch.equal(a.layers[0].qkv_proj, c.layers[0].qkv_proj)


def test_fp8_dummy_is_built_straight_into_fp8_and_equals_the_dense_one_quantized(
    config_only: Path,
) -> None:
    cfg = ModelConfig.from_pretrained(config_only)
    fp8 = dummy_model(cfg, torch.float32, fp8=True, seed=5)
    dense = dummy_model(cfg, torch.float32, seed=5)
    quantized = copy.deepcopy(dense)
    quantized.quantize_fp8()
    assert fp8.quantization == "fp8"
    for ours, ref in zip(fp8.layers, quantized.layers, strict=True):
        assert ours.qkv_proj.numel() == 0  # no dense projection was ever allocated for it
        for name, linear in ours.quantized.items():  # type: ignore[union-attr]
            other = ref.quantized[name]  # type: ignore[index]
            assert linear.weight.dtype == FP8_DTYPE
            assert torch.equal(linear.weight.view(torch.uint8), other.weight.view(torch.uint8))
            assert torch.equal(linear.weight_scale, other.weight_scale)
    assert fp8.weight_bytes == quantized.weight_bytes
    # one byte per projection weight, dense embeddings/head/norms in float32
    projections = sum(r * c for r, c in projection_shapes(cfg).values()) * cfg.num_layers
    assert dense.weight_bytes - fp8.weight_bytes == projections * 3 - cfg.num_layers * 4 * 4
    torch.testing.assert_close(logits(fp8, [1, 2, 3]), logits(quantized, [1, 2, 3]))


def test_an_engine_serves_a_config_only_folder_with_fp8_dummy_weights(config_only: Path) -> None:
    from engine.core.engine import LLMEngine
    from vocabulary.sampling import SamplingParams

    config = EngineConfig(
        model_dir=str(config_only), device="cpu", dtype="float32", num_kv_blocks=32,
        cuda_graphs=False, attention_backend="torch", quantization="fp8", load_format="dummy",
    )  # fmt: skip
    engine = LLMEngine(config)
    assert engine.model.quantization == "fp8" and engine.tokenizer.vocab_size == 512
    (tokens,) = engine.generate(
        [list(range(1, 20))], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert len(tokens) == 12 and all(0 <= t < 1000 for t in tokens)
    # ids past the tokenizer's vocabulary decode to no text instead of failing the request
    assert engine.tokenizer.decode([999]) == ""
