"""INT8 W8A8's one-kernel GEMM on CPU (engine/quantization/int8_gemm.py) in Triton's
interpreter against the torch ops `Int8Linear` runs on CPU: bit for bit (integer sums are
exact, the rescale is the same float32 products in the same order, bf16 rounded to nearest
even), every bucket's config and explicit split-K / swizzle / quantize-first tilings, rows
and widths that are no multiple of a tile. On a GPU (tests/gpu/test_int_gpu.py): the same,
also replayed from a CUDA graph."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton_interpret

from engine.quantization import int8_gemm
from engine.quantization.int8_gemm import GemmConfig
from engine.quantization.int8_linear import (
    _MIN_SCALE,
    HALF_RANGE,
    INT8_MAX,
    Int8Linear,
    auto_kernels,
    quantize_rows_int8,
    triton_ready,
)

ROWS = (1, 3, 16, 17, 40)
TILINGS = (
    None,  # the bucket's config
    GemmConfig(16, 32, 64, 3, 1, 4, 2, True),  # split-K in three, quantized in the prologue
    GemmConfig(16, 16, 128, 0, 1, 4, 2, False),  # split to fill the SMs, x quantized first
    GemmConfig(32, 32, 64, 1, 2, 4, 2, False),  # swizzled row tiles, no split
    GemmConfig(16, 32, 64, 3, 1, 4, 2, True, swap_ab=True),  # out.T = W @ x.T
)


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `triton_interpret.interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    xs, weight, scale = torch.load(inputs, weights_only=False)
    int8_gemm.reserve(torch.device("cpu"), weight.shape[0])
    outs: list[object] = []
    for x in xs:
        for config in TILINGS:
            for dtype in (torch.float32, torch.bfloat16):
                outs.append(
                    int8_gemm.matmul(x, weight, scale, dtype, HALF_RANGE, _MIN_SCALE, config)
                )
    acc, counters = int8_gemm._WORKSPACES[torch.device("cpu")]
    outs.append(bool(acc.any() or counters.any()))
    torch.save(outs, outputs)


def _inputs(n: int, k: int) -> tuple[list[torch.Tensor], Int8Linear]:
    gen = torch.Generator().manual_seed(11)
    w, ws = quantize_rows_int8(torch.randn(n, k, generator=gen), INT8_MAX)
    xs = []
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        x[0] *= 1000.0  # per-token scales: the loud row leaves the others alone
        if rows >= 3:
            x[1] = 0.0  # the smallest scale, all zeros
            x[2] = 0.25
            x[2, :5] = torch.tensor([127.5, 0.5, 1.5, -2.5, -0.5])  # scale 1: ties
        xs.append(x.to(torch.bfloat16))
    return xs, Int8Linear(w, ws.reshape(n), None)


def test_the_gemm_computes_the_torch_ops_numbers_bit_for_bit(tmp_path: Path) -> None:
    n, k = 72, 700  # neither a multiple of a tile
    xs, layer = _inputs(n, k)
    got = triton_interpret.interpret(__file__, (xs, layer.weight, layer.weight_scale), tmp_path)
    dirty = got.pop()
    assert not dirty  # every split-K call left its workspace and counters zero
    results = iter(got)
    for x in xs:
        for config in TILINGS:
            for dtype in (torch.float32, torch.bfloat16):
                out = next(results)
                want = layer(x, out_dtype=dtype)
                assert out.dtype == dtype and out.shape == (x.shape[0], n)
                assert torch.equal(out, want), (x.shape[0], config, dtype)


def test_the_tilings_under_test_split_k_and_fuse_the_quantization() -> None:
    cpu = torch.device("cpu")
    assert int8_gemm.splits(TILINGS[1], 3, 72, 700, cpu) == 3
    assert int8_gemm.splits(TILINGS[2], 3, 72, 700, cpu) == 2  # 5 column tiles, 8 "SMs"
    assert int8_gemm.splits(TILINGS[3], 3, 72, 700, cpu) == 1
    assert int8_gemm.config_for(1).quantize_in_prologue
    assert not int8_gemm.config_for(4096).quantize_in_prologue
    assert int8_gemm.splits(int8_gemm.config_for(4096), 4096, 4096, 4096, cpu) == 1
    # past the rows the workspace holds, never split
    assert int8_gemm.splits(TILINGS[1], int8_gemm.SPLIT_MAX_ROWS + 1, 72, 700, cpu) == 1


def test_buckets_cover_every_row_count_in_ascending_order() -> None:
    tops = list(int8_gemm.CONFIGS)
    assert tops == sorted(tops) and tops[-1] >= 1 << 40
    assert int8_gemm.config_for(16) is int8_gemm.CONFIGS[16]
    assert int8_gemm.config_for(17) is int8_gemm.CONFIGS[64]


def test_mismatched_widths_are_refused() -> None:
    w = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="x has 32 columns, the weight 64"):
        int8_gemm.matmul(torch.zeros(2, 32), w, torch.ones(8), torch.float32, 127.5, 1e-7)


def test_the_kernel_choice_is_checked_and_cpu_keeps_the_torch_ops() -> None:
    layer = Int8Linear(torch.ones(8, 16, dtype=torch.int8), torch.ones(8), None)
    with pytest.raises(ValueError, match="kernels 'cutlass'"):
        layer.kernels = "cutlass"
    layer.kernels = "triton"
    x = torch.randn(3, 16)
    q, s = quantize_rows_int8(x)
    want = (q.float().sum(dim=1, keepdim=True) * s).expand(3, 8)
    assert torch.equal(layer(x), want)  # CPU: the torch ops whatever the choice
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not triton_ready(torch.device("cpu"))


def test_auto_is_the_default_and_runs_triton_for_decode_and_long_prefills_fused_between() -> None:
    """Every choice gives the same numbers (the GPU test checks both sides of each
    threshold), so 'auto' picks by rows: decode-sized and long inputs on the Triton GEMM, the
    fused kernels between (the H100 figures in int8_linear.TRITON_MIN_PREFILL_ROWS)."""
    assert Int8Linear(torch.ones(8, 16, dtype=torch.int8), torch.ones(8), None).kernels == "auto"
    picks = {rows: auto_kernels(rows) for rows in (1, 8, 9, 64, 255, 256, 4096)}
    assert picks == {1: "triton", 8: "triton", 9: "fused", 64: "fused", 255: "fused",
                     256: "triton", 4096: "triton"}  # fmt: skip
