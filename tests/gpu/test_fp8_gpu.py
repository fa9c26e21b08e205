"""FP8 weights on the GPU (cuBLASLt `_scaled_mm`): the GEMM computes what the CPU path
(dequantized matmul) does up to bf16 rounding, inside a CUDA graph too; the tiny model's
greedy tokens with FP8 weights equal bf16's but at near-ties (the margin rule of
tests/integration/engine/test_engine_fp8.py), through the engine's CUDA-graph decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp8_reference import GPU_GREEDY, GPU_TEXTS, greedy_margin_check

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.quantization.fp8_linear import Fp8Linear, quantize_per_token

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_scaled_mm_matches_the_dequantized_matmul(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    b = torch.randn(512, device="cuda", generator=g).bfloat16()
    x = torch.randn(m, 256, device="cuda", generator=g).bfloat16()
    layer = Fp8Linear.from_weight(w, b)
    got = layer(x).float()
    amax = x.float().abs().amax() / 448.0
    xq = (x / amax).clamp(-448, 448).to(torch.float8_e4m3fn).float() * amax
    want = F.linear(xq, layer.dequantized(torch.float32), b.float())
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("m", [1, 16, 300, 1000])
@pytest.mark.parametrize("per_channel", [False, True])
def test_row_wise_scaled_mm_per_token_matches_the_dequantized_matmul(
    m: int, per_channel: bool
) -> None:
    """Per-token activations (and per-channel weights) run cuBLASLt row-wise: each row of x by
    its own scale; a row 1000x louder leaves the others alone. The GEMM is checked against
    float32 over the same e4m3 operands (each row to ~1 % of its size: bf16 output). The
    quantization of x is the CPU path's but for rare elements where the GPU's float -> e4m3
    conversion rounds the other way (an H100 showed 1-5 rows of 512 with one such element):
    at most one e4m3 step apart, in at most 1 element in 10,000."""
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    b = torch.randn(512, device="cuda", generator=g).bfloat16()
    x = torch.randn(m, 256, device="cuda", generator=g).bfloat16()
    x[0] *= 1000.0
    dense = Fp8Linear.from_weight(w, b)
    scale = dense.weight_scale
    if per_channel:
        amax = w.float().abs().amax(dim=1)
        scale = amax / 448.0
        weight = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        weight = dense.weight
    layer = Fp8Linear(weight, scale, b, dynamic="token")
    got = layer(x).float()
    x_q, x_scale = layer.quantize_input(x)
    want = F.linear(x_q.float() * x_scale, layer.dequantized(torch.float32), b.float())
    rows = want.abs().amax(dim=1, keepdim=True)  # bf16 output: each row to ~1 % of its size
    assert bool(((got - want).abs() <= 1e-2 * rows).all())
    cpu_q, cpu_scale = quantize_per_token(x.cpu().float())
    assert torch.equal(cpu_scale.cuda(), x_scale)
    differ = (cpu_q.float().cuda() != x_q.float()).sum().item()
    assert differ <= max(1, x.numel() // 10_000), differ
    # one e4m3 step at most: 1/8 of the value (3 mantissa bits), 2**-9 among the subnormals
    gap = (cpu_q.float().cuda() - x_q.float()).abs()
    assert bool((gap <= 0.125 * x_q.float().abs() + 2**-9).all())


def test_fp8_linear_replays_in_a_cuda_graph() -> None:
    layer = Fp8Linear.from_weight(torch.randn(256, 128, device="cuda").bfloat16())
    x = torch.randn(8, 128, device="cuda").bfloat16()
    eager = layer(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(x * 2)
    graph.replay()
    assert torch.allclose(out.float(), layer(x).float())
    assert not torch.equal(out, eager)


def test_tiny_model_fp8_greedy_equals_bf16_but_at_near_ties(tiny_model_dir: Path) -> None:
    base = dict(model_dir=str(tiny_model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256)
    dense = LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]
    fp8 = LLMEngine(EngineConfig(**base, quantization="fp8"))  # type: ignore[arg-type]
    assert fp8.model.quantization == "fp8"
    prompts = [dense.tokenizer.encode(text) for text in GPU_TEXTS]
    greedy_margin_check(dense, fp8, prompts, GPU_GREEDY, inclusive=True)
