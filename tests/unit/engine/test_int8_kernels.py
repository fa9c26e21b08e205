"""INT8 W8A8's fused CUDA path on CPU (engine/quantization/int8_kernels.py): the per-token
quantize and the rescale kernels in Triton's interpreter against the torch ops `Int8Linear`
runs on CPU. On a GPU (tests/gpu/test_int_gpu.py): the same, bit for bit, in a CUDA graph."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton_interpret

from engine.quantization import int8_kernels
from engine.quantization.int8_linear import _MIN_SCALE, HALF_RANGE, fused_ready, quantize_rows_int8


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `triton_interpret.interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    xs, (acc, scale, ws, rows) = torch.load(inputs, weights_only=False)
    outs: list[object] = [int8_kernels.quantize_rows(x, HALF_RANGE, _MIN_SCALE, 17) for x in xs]
    outs.append(int8_kernels.rescale(acc, scale, ws, rows, torch.float32))
    outs.append(int8_kernels.rescale(acc, scale, ws, rows, torch.bfloat16))
    torch.save(outs, outputs)


def test_the_kernels_compute_the_torch_ops_numbers(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    ties = torch.full((2, 1500), 0.25)
    ties[0, :5] = torch.tensor([127.5, 0.5, 1.5, -2.5, -0.5])  # scale 1: every value a tie
    ties[1] = 0.0  # a zero row: the smallest scale, all zeros
    xs = [
        torch.randn(3, 3000, generator=gen),  # wider than one block of columns
        torch.randn(40, 200, generator=gen).to(torch.bfloat16),  # more rows than the padding
        ties,
    ]
    acc = torch.randint(-(2**24), 2**24, (17, 300), generator=gen, dtype=torch.int32)
    scale = torch.rand(5, 1, generator=gen) / 100
    ws = torch.rand(300, generator=gen) + 0.5
    got = triton_interpret.interpret(__file__, (xs, (acc, scale, ws, 5)), tmp_path)
    for x, (q, s) in zip(xs, got[:3], strict=True):
        want_q, want_s = quantize_rows_int8(x)
        rows = x.shape[0]
        assert q.shape == (max(rows, 17), x.shape[1]) and q.dtype == torch.int8
        assert torch.equal(q[:rows], want_q) and torch.equal(s, want_s)
        assert not q[rows:].any()  # the padding `_int_mm` wants: zero rows
    want = acc[:5].float() * scale * ws
    assert torch.equal(got[3], want)
    # the interpreter truncates float32 -> bf16 (the GPU rounds to nearest even: the GPU test
    # and `verified` hold it exactly there): within one bf16 step here
    step = want.abs() * 2**-7
    assert bool(((got[4].float() - want).abs() <= step).all())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted here")
def test_without_cuda_or_the_interpreter_the_layer_keeps_the_torch_ops() -> None:
    assert int8_kernels.unavailable_reason(torch.device("cpu")) is not None
    assert not fused_ready(torch.device("cpu"))
