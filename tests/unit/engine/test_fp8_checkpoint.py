"""Pre-quantized FP8 checkpoints (engine/loading/fp8_checkpoint.py): the compressed-tensors config
is read as llm-compressor writes it and refused naming the key otherwise; fused and per-channel
parts are requantized to one scale per tensor within one e4m3 rounding; checkpoints that `pdserve
make-model --quantization fp8` writes (per channel and per tensor) load straight into FP8 layers; a
dense checkpoint quantized while loading equals quantizing it after."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from deploy.cli.app import app
from engine.loading.fp8_checkpoint import Fp8Part, Fp8Scheme, fuse_parts, read_fp8_scheme
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel
from engine.quantization.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, a
# subnormal one (below 2^-6 * scale) by at most half the subnormal step 2^-9 * scale
REL_STEP, SUBNORMAL_STEP = 2.0**-4, 2.0**-10


def within_one_rounding(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """`scale`: [] or one per row ([rows, 1])."""
    bound = want.abs() * REL_STEP + scale.float() * SUBNORMAL_STEP
    return bool(((got - want).abs() <= bound * (1 + 1e-6)).all())


def part(name: str, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Part:
    """An Fp8Part of `weight` quantized with `scale` ([] per tensor, [rows, 1] per row)."""
    if scale is None:
        return Fp8Part(name, weight)
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Part(name, q, scale.float())


def group(weights: dict, acts: dict | None, **extra: object) -> dict:
    return {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts, **extra}},
        "ignore": ["lm_head"],
    }}  # fmt: skip


FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


# ---- the config ----------------------------------------------------------------------------


def test_the_config_llm_compressor_writes_is_read_as_its_scheme() -> None:
    dynamic = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert read_fp8_scheme({"model_type": "llama"}) is None
    assert read_fp8_scheme(group({**FP8_W, "strategy": "channel"}, dynamic)) == Fp8Scheme(
        "channel", dynamic_activations=True
    )
    assert read_fp8_scheme(group({**FP8_W, "strategy": "tensor"}, static)) == Fp8Scheme(
        "tensor", dynamic_activations=False
    )
    assert read_fp8_scheme(group({**FP8_W, "strategy": "tensor"}, None)) == Fp8Scheme(
        "tensor", dynamic_activations=True, activation_strategy="none"
    )  # weights only: activations stay in the model dtype
    schemes = (
        Fp8Scheme(), Fp8Scheme("tensor", dynamic_activations=False),
        Fp8Scheme(activation_strategy="tensor"), Fp8Scheme(activation_strategy="none"),
    )  # fmt: skip
    for scheme in schemes:
        assert read_fp8_scheme({"quantization_config": scheme.quantization_config()}) == scheme


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
         "quant_method 'fp8' is not supported"),
        (group({**FP8_W, "num_bits": 4}, None), "group_0.weights: 4-bit float is not supported"),
        (group({**FP8_W, "strategy": "block", "block_structure": [128, 128]}, None),
         "strategy 'block' is not supported"),
        (group({**FP8_W, "symmetric": False}, None), "asymmetric quantization"),
        (group({**FP8_W, "strategy": "tensor"},
               {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
         "dynamic=False strategy 'token' is not supported"),
        (group({**FP8_W, "strategy": "tensor"}, None, format="pack-quantized"),
         "format 'pack-quantized' is not supported"),
    ],
)  # fmt: skip
def test_other_quantizations_are_refused_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_fp8_scheme(config)


# ---- requantizing fused parts --------------------------------------------------------------


def test_fused_per_tensor_parts_sharing_one_scale_keep_their_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor(0.01)
    parts = [part(n, torch.randn(r, 8, generator=gen)) for n, r in (("q", 16), ("k", 8))]
    parts = [part(p.name, p.weight, scale) for p in parts]  # type: ignore[arg-type]
    weight, got_scale, input_scale = fuse_parts(parts)
    want = torch.cat([p.weight for p in parts])  # type: ignore[misc]
    assert torch.equal(weight.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_scale, scale) and input_scale is None


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fused_parts_with_their_own_scales_keep_their_bytes_with_a_scale_per_row(
    strategy: str,
) -> None:
    gen = torch.Generator().manual_seed(1)
    dense = [torch.randn(32, 16, generator=gen) * s for s in (1.0, 0.05, 0.3)]  # q, k, v
    parts = []
    for name, w in zip("qkv", dense, strict=True):
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
        parts.append(part(name, w, amax / FP8_MAX))
    weight, scale, _ = fuse_parts(parts)
    assert weight.dtype == FP8_DTYPE and scale.shape == (96,)
    want = torch.cat([p.weight for p in parts])  # type: ignore[misc]
    assert torch.equal(weight.view(torch.uint8), want.view(torch.uint8))  # no second rounding
    checkpoint = torch.cat([p.dequantized() for p in parts])  # what the checkpoint says
    assert torch.equal(weight.float() * scale[:, None], checkpoint)
    linear = Fp8Linear(weight, scale, None, dynamic="token")
    assert linear.per_channel and torch.equal(linear.dequantized(torch.float32), checkpoint)


def test_a_dense_part_joins_a_quantized_one_and_static_input_scales_take_the_max() -> None:
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    quantized = part("gate", gate, gate.abs().amax() / FP8_MAX)
    quantized.input_scale = torch.tensor([0.02])
    other = part("up", up, up.abs().amax() / FP8_MAX)
    other.input_scale = torch.tensor([0.05])
    _, _, input_scale = fuse_parts([quantized, other])
    assert input_scale is not None and float(input_scale) == pytest.approx(0.05)
    dense = Fp8Part("up", up)  # a module the checkpoint left unquantized: quantized per row
    weight, scale, input_scale = fuse_parts([quantized, dense])
    assert scale.shape == (16,)
    assert torch.equal(weight[:8].view(torch.uint8), quantized.weight.view(torch.uint8))  # type: ignore[union-attr]
    want = torch.cat([quantized.dequantized(), up])
    assert within_one_rounding(weight.float() * scale[:, None], want, scale[:, None])
    assert input_scale is not None and float(input_scale) == pytest.approx(0.02)


# ---- checkpoints written by make-model -----------------------------------------------------


def make_fp8(tmp_path: Path, src: Path, *options: str) -> Path:
    out = tmp_path / "fp8"
    result = CliRunner().invoke(
        app, ["make-model", str(out), "--quantization", "fp8", "--from", str(src), *options]
    )
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("options", [(), ("--weight-scales", "tensor", "--activations", "static")])
def test_make_model_fp8_checkpoint_loads_into_fp8_layers(
    tmp_path: Path, tiny_model_dir: Path, options: tuple[str, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    out = make_fp8(tmp_path, tiny_model_dir, *options)
    tensors = load_file(out / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj"
    assert tensors[f"{q}.weight"].dtype == FP8_DTYPE
    per_channel = not options
    assert tuple(tensors[f"{q}.weight_scale"].shape) == ((128, 1) if per_channel else (1,))
    assert (f"{q}.input_scale" in tensors) is not per_channel
    assert tensors["lm_head.weight"].dtype == torch.float32  # ignored: dense
    dense = load_model(tiny_model_dir, torch.float32)
    with caplog.at_level(logging.INFO, logger="engine.loading.loaders"):
        model = load_model(out, torch.float32)  # quantization "none": the checkpoint decides
    assert model.quantization == "fp8" and "an FP8 checkpoint" in caplog.text
    assert model.weight_bytes < dense.weight_bytes
    torch.testing.assert_close(model.lm_head, dense.lm_head, rtol=0, atol=0)
    for i, (ours, ref) in enumerate(zip(model.layers, dense.layers, strict=True)):
        assert ours.quantized is not None and ours.qkv_proj.numel() == 0
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = ours.quantized[name]
            assert isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8_DTYPE
            assert (linear.input_scale is None) is per_channel
            # as the checkpoint declares: dynamic per-token activations, or its static scales
            assert linear.activations == ("token" if per_channel else "static")
            # the checkpoint's one e4m3 rounding of the dense weight, kept as it is
            want, got = getattr(ref, name), linear.dequantized(torch.float32)
            rows = linear.weight_scale.reshape(-1, 1) if linear.per_channel else linear.weight_scale
            bound = want.abs() * REL_STEP * 1.01 + rows * SUBNORMAL_STEP
            assert bool(((got - want).abs() <= bound).all()), (i, name)
    if not per_channel:  # static: the max of q/k/v's observed input scales (all one input)
        scale = float(model.layers[1].quantized["qkv_proj"].input_scale)  # type: ignore[index]
        assert scale == pytest.approx(float(tensors[f"{q}.input_scale"]))


def test_dense_checkpoint_quantized_while_loading_equals_quantizing_after(
    tiny_model_dir: Path,
) -> None:
    streamed = load_model(tiny_model_dir, torch.float32, quantization="fp8")
    after = copy.deepcopy(load_model(tiny_model_dir, torch.float32))
    after.quantize_fp8()
    for a, b in zip(streamed.layers, after.layers, strict=True):
        for name, linear in a.quantized.items():  # type: ignore[union-attr]
            other = b.quantized[name]  # type: ignore[index]
            assert torch.equal(linear.weight.view(torch.uint8), other.weight.view(torch.uint8))
            assert torch.equal(linear.weight_scale, other.weight_scale)
    assert streamed.weight_bytes == after.weight_bytes


def test_loader_names_a_missing_scale_and_a_misshapen_part(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = make_fp8(tmp_path, tiny_model_dir)
    tensors = load_file(out / "model.safetensors")
    scale = tensors.pop("model.layers.2.self_attn.k_proj.weight_scale")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing model\.layers\.2\.self_attn\.k_proj\.weight_sc"):
        load_model(out, torch.float32)
    tensors["model.layers.2.self_attn.k_proj.weight_scale"] = scale[:5]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale has shape \(5, 1\)"):
        load_model(out, torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4-bit float is not supported"):
        load_model(out, torch.float32)


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    from engine.modeling.llama import causal_attend

    attend = causal_attend(1, len(ids), model.cfg.num_heads, model.cfg.num_kv_heads)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attend))


def test_fp8_checkpoint_logits_are_as_close_to_the_dense_models_as_quantizing_at_load(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from vocabulary.tokenizer import Tokenizer

    out = make_fp8(tmp_path, tiny_model_dir)
    ids = Tokenizer.from_model_dir(tiny_model_dir).encode("The river runs past the old mill")
    want = _logits(load_model(tiny_model_dir, torch.float32), ids)
    at_load = _logits(load_model(tiny_model_dir, torch.float32, quantization="fp8"), ids)
    got = _logits(load_model(out, torch.float32), ids)
    err, err_at_load = float((got - want).abs().max()), float((at_load - want).abs().max())
    # per-channel scales requantized to one per tensor: about the error of quantizing the
    # dense weights per tensor directly (measured 1.07x), not more
    assert 0 < err < 1.5 * err_at_load, (err, err_at_load)
