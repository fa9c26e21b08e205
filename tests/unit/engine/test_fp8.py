"""FP8 (e4m3) per-tensor quantization and the CPU path of Fp8Linear, exact on hand-made
inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quantization.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_per_tensor


def test_per_tensor_scale_maps_the_largest_magnitude_to_448() -> None:
    w = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    q, scale = quantize_per_tensor(w)
    assert q.dtype == FP8_DTYPE and float(scale) == pytest.approx(2.0 / FP8_MAX)
    assert float(q.float().abs().max()) == FP8_MAX
    # powers of two times the scale are exact in e4m3
    assert torch.equal(q.float() * scale, w)


def test_quantization_error_is_within_e4m3_precision() -> None:
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_per_tensor(w)
    back = q.float() * scale
    # 3 mantissa bits: relative error <= 2^-4 for values in the normal range
    normal = w.abs() > scale * 2**-6
    rel = ((back - w).abs() / w.abs())[normal]
    assert float(rel.max()) <= 2**-4 + 1e-6


def test_an_all_zero_tensor_quantizes_without_nan() -> None:
    q, scale = quantize_per_tensor(torch.zeros(4, 4))
    assert float(scale) > 0 and torch.equal(q.float(), torch.zeros(4, 4))


def test_cpu_forward_is_the_quantized_activation_times_the_dequantized_weight() -> None:
    g = torch.Generator().manual_seed(1)
    w, b, x = (
        torch.randn(32, 16, generator=g),
        torch.randn(32, generator=g),
        torch.randn(5, 16, generator=g),
    )
    layer = Fp8Linear.from_weight(w, b)
    xq, xs = quantize_per_tensor(x)
    want = F.linear(xq.float() * xs, layer.weight.float() * layer.weight_scale, b)
    assert torch.allclose(layer(x), want, rtol=0, atol=1e-6)
    assert float((layer(x) - F.linear(x, w, b)).abs().max()) < 0.2 * float(
        F.linear(x, w, b).abs().max()
    )


def test_fp8_linear_refuses_a_dense_weight() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Fp8Linear(torch.zeros(4, 4), torch.tensor(1.0), None)
