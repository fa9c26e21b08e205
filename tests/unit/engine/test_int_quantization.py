"""INT8 / INT4 pieces against float references: the int4 packing against compressed-tensors'
own, the linear layers against the arithmetic their scheme declares, the config reader's
refusals, the TP split of packed weights in whole groups, and the weight format in the
hand-off's compatibility fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deploy.checkpoints.make_model import make_model
from engine.kv.kv_cache import KVCacheSpec
from engine.loading.checkpoint_scheme import read_checkpoint_scheme
from engine.loading.fp8_checkpoint import Fp8Scheme
from engine.loading.int_checkpoint import IntScheme
from engine.loading.loaders import load_model
from engine.quantization.int4_linear import (
    Int4Linear,
    pack_int4,
    quantize_groups_int4,
    unpack_int4,
)
from engine.quantization.int8_linear import Int8Linear, int_matmul, quantize_rows_int8
from engine.tp.tp_shard import TPShard, tensor_slice
from kv_transfer.types import compat_fields
from vocabulary.model_config import ModelConfig

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


# ---- int4 packing --------------------------------------------------------------------------


@pytest.mark.parametrize("cols", [8, 13, 128, 384])
def test_int4_packing_is_compressed_tensors_pack_to_int32(cols: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (6, cols), dtype=torch.int8, generator=GEN)
    packed = pack_int4(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed, cols), q)


def test_int4_packing_refuses_values_outside_the_range() -> None:
    with pytest.raises(ValueError, match=r"outside \[-8, 7\]"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))


def test_int4_group_rounding_keeps_each_groups_largest_weight() -> None:
    w = randn(4, 256)
    q, scale = quantize_groups_int4(w, 128)
    assert scale.shape == (4, 2) and int(q.abs().max()) == 7 and int(q.min()) >= -7
    back = q.float().view(4, 2, 128) * scale.unsqueeze(-1)
    amax_at = w.view(4, 2, 128).abs().argmax(-1, keepdim=True)
    assert torch.allclose(
        back.gather(-1, amax_at), w.view(4, 2, 128).gather(-1, amax_at), rtol=1e-6
    )
    assert float((back.reshape(4, 256) - w).abs().max()) <= float(scale.max()) / 2 + 1e-6


# ---- the linear layers ---------------------------------------------------------------------


def test_int8_linear_is_the_per_token_per_channel_arithmetic() -> None:
    w, x, bias = randn(48, 40), randn(5, 40) * 3, randn(48)
    w_scale = w.abs().amax(1) / 127
    q_w = (w / w_scale[:, None]).round().to(torch.int8)
    out = Int8Linear(q_w, w_scale, bias)(x)
    # the declared scheme: x per row by amax / 127.5 in float32 (as compressed-tensors
    # rounds it, half to even), the sum of int products and the rescale in float64
    x_scale = x.abs().amax(1, keepdim=True) / 127.5
    q_x = (x / x_scale).round().clamp(-128, 127).double()
    want = (q_x @ q_w.double().t()) * x_scale.double() * w_scale.double() + bias.double()
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-5)


def test_int8_linear_matches_compressed_tensors_fake_quantization() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    w, x = randn(32, 64), randn(9, 64)
    w_scale = w.abs().amax(1) / 127
    q_w = (w / w_scale[:, None]).round().to(torch.int8)
    amax = x.abs().amax(1, keepdim=True)
    scale, zero = calculate_qparams(-amax, amax, args)
    x_dq = fake_quantize(x, scale, zero, args)
    want = F.linear(x_dq, q_w.float() * w_scale[:, None])
    assert torch.allclose(Int8Linear(q_w, w_scale, None)(x), want, rtol=1e-5, atol=1e-5)


def test_int8_rows_quantize_alone() -> None:
    x = randn(3, 16)
    loud = torch.cat([x, 1000 * randn(1, 16)])
    assert torch.equal(quantize_rows_int8(loud)[0][:3], quantize_rows_int8(x)[0])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 100, 36), (3, 13, 7), (20, 128, 384)])
def test_int_matmul_is_exact(m: int, k: int, n: int) -> None:
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=GEN)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=GEN)
    assert torch.equal(int_matmul(a, b), a.int() @ b.int().t())


def test_int4_linear_dequantizes_group_wise() -> None:
    w, x, bias = randn(24, 256), randn(5, 256), randn(24)
    q, scale = quantize_groups_int4(w, 64)
    linear = Int4Linear(pack_int4(q), scale, 256, 64, bias)
    want_w = torch.stack(
        [torch.cat([q[r, g * 64 : (g + 1) * 64].float() * scale[r, g] for g in range(4)])
         for r in range(24)]
    )  # fmt: skip
    assert torch.equal(linear.dequantized(torch.float32), want_w)
    assert torch.allclose(linear(x), x @ want_w.t() + bias, rtol=1e-5, atol=1e-5)
    assert linear(x, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_int4_linear_refuses_scales_of_another_group_size() -> None:
    q, scale = quantize_groups_int4(randn(8, 256), 128)
    with pytest.raises(ValueError, match=r"weight_scale of shape \(8, 2\), want \(8, 4\)"):
        Int4Linear(pack_int4(q), scale, 256, 64, None)


# ---- the config reader ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [IntScheme(8), IntScheme(4, 128), IntScheme(4, 32)])
def test_written_int_configs_read_back(scheme: IntScheme) -> None:
    assert read_checkpoint_scheme({"quantization_config": scheme.quantization_config()}) == scheme


def test_fp8_and_dense_configs_still_read() -> None:
    fp8 = Fp8Scheme()
    assert read_checkpoint_scheme({"quantization_config": fp8.quantization_config()}) == fp8
    assert read_checkpoint_scheme({"model_type": "llama"}) is None


def _int_config(bits: int, **group: object) -> dict:
    qc = IntScheme(bits, 128 if bits == 4 else 0).quantization_config()
    qc["config_groups"]["group_0"].update(group)
    return {"quantization_config": qc}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}},
         "quant_method 'awq' is not supported"),
        (_int_config(4, input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                           "dynamic": True}),
         "int4 with quantized activations is not supported"),
        (_int_config(8, input_activations=None), "int8 weights need dynamic per-token"),
        (_int_config(8, format="pack-quantized"), "format 'pack-quantized' with 8-bit weights"),
        ({"quantization_config": {**IntScheme(8).quantization_config(),
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float"}}},
         "kv_cache_scheme: not supported"),
        ({"quantization_config": {**IntScheme(8).quantization_config(), "config_groups": {
            "group_0": IntScheme(8).quantization_config()["config_groups"]["group_0"],
            "group_1": {**Fp8Scheme().quantization_config()["config_groups"]["group_0"],
                        "format": "float-quantized"}}}},
         "do not load together"),
    ],
)  # fmt: skip
def test_int_schemes_not_computed_are_refused_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_checkpoint_scheme(config)


# ---- tensor parallelism and the hand-off ---------------------------------------------------

CFG = ModelConfig.from_dict(
    {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 384,
     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
)  # fmt: skip


def test_tp_cuts_packed_row_parallel_weights_in_whole_groups() -> None:
    name = "model.layers.0.mlp.down_proj.weight_"
    rank1 = TPShard(2, 1)  # input columns [192, 384) of 384
    assert tensor_slice(name + "packed", (128, 48), CFG, rank1).start == 24
    part = tensor_slice(name + "scale", (128, 12), CFG, rank1)  # groups of 32
    assert (part.dim, part.start, part.stop) == (1, 6, 12)
    with pytest.raises(ValueError, match="split a group of 128"):
        tensor_slice(name + "scale", (128, 3), CFG, rank1)
    assert tensor_slice("model.layers.0.mlp.up_proj.weight_scale", (384, 1), CFG, rank1).dim == 0


def test_a_tp_rank_of_an_int4_checkpoint_holds_the_whole_models_slices(tmp_path: Path) -> None:
    path = make_model(tmp_path / "g32", int_scheme=IntScheme(4, 32), train_steps=0, num_layers=1)
    whole = load_model(path, torch.float32)
    part = load_model(path, torch.float32, shard=TPShard(2, 1))
    assert part.quantization == "int4"
    mine, all_ = part.layers[0].quantized, whole.layers[0].quantized  # type: ignore[union-attr]
    down = all_["down_proj"].dequantized(torch.float32)  # type: ignore[index,operator]
    assert torch.equal(mine["down_proj"].dequantized(torch.float32), down[:, 192:])  # type: ignore[index,operator]
    up = all_["gate_up_proj"].dequantized(torch.float32)[384:]  # type: ignore[index,operator]
    assert torch.equal(mine["gate_up_proj"].dequantized(torch.float32)[192:], up[192:])  # type: ignore[index,operator]


def test_the_weight_format_joins_the_compatibility_fields() -> None:
    spec = KVCacheSpec(num_blocks=4, num_layers=1, block_size=16, num_kv_heads=2, head_dim=32,
                       dtype="float32")  # fmt: skip
    dense = compat_fields(spec, "m")
    assert "weights=" not in dense  # a dense model's pool hashes as before
    int4 = KVCacheSpec(**{**spec.__dict__, "weights": "int4"})
    assert compat_fields(int4, "m") == dense + ";weights=int4"
