"""INT4 W4A16's Triton kernels on CPU (engine/quantization/int4_gemm.py): the interleaved
layout made from compressed-tensors' words and read back, the dequantize kernel writing the
CPU path's weight bit for bit, and the small-M GEMM in Triton's interpreter against the CPU
path within bf16 GEMM precision (`int4_gemm.within_tolerance`: the output's rounding, 2^-8
relative, plus float32 accumulation's bound K 2^-24 sum |x||w|), a row's numbers the same
whatever the batch (bit for bit), run to run, split-K or not. On a GPU
(tests/gpu/test_int_gpu.py): the same, also replayed from a CUDA graph."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import triton_interpret

from engine.quantization import int4_gemm
from engine.quantization.int4_linear import Int4Linear, pack_int4, quantize_groups_int4

CPU = torch.device("cpu")
SPLIT = dataclasses.replace(int4_gemm.CONFIG, split_k=3)
WHOLE_K = dataclasses.replace(int4_gemm.CONFIG, split_k=1, spans=2)
SWAPPED = dataclasses.replace(int4_gemm.CONFIG, split_k=3, swap_ab=True)
TILINGS = (None, SPLIT, WHOLE_K, SWAPPED)


def _layer(n: int, k: int, group: int, seed: int = 0) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_groups_int4(torch.randn(n, k, generator=gen), group)
    return Int4Linear(pack_int4(q), scale, k, group, None)


def test_layout_round_trips_and_puts_chunk_i_in_nibble_i() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (5, 384), generator=gen, dtype=torch.int8)
    words = int4_gemm.interleave(pack_int4(q), 384, rows_at_once=2)
    assert words.shape == (5, 48) and words.dtype == torch.int32
    assert torch.equal(int4_gemm.deinterleave(words), q)
    # row 3, span 2, word j 5, nibble i 6: column 128 * 2 + 16 * 6 + 5
    word = int(words[3, 2 * 16 + 5]) & 0xFFFFFFFF
    assert (word >> 24) & 0xF == int(q[3, 256 + 96 + 5]) + 8


def test_dequantize_without_triton_is_the_cpu_paths_weight() -> None:
    layer = _layer(48, 256, 32)
    words = int4_gemm.interleave(layer.weight_packed, 256)
    out = torch.empty(48, 256)
    int4_gemm.dequantize(words, layer.weight_scale, 32, out)
    assert torch.equal(out, layer.dequantized(torch.float32))


def test_shapes_the_layout_cannot_hold_are_refused() -> None:
    assert int4_gemm.fits(72, 256, 32) and int4_gemm.fits(72, 256, 128)
    assert not int4_gemm.fits(72, 200, 8)  # in not a multiple of 128
    assert not int4_gemm.fits(72, 256, 8)  # a group smaller than a 16-column chunk
    words = torch.zeros(8, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="want bf16 x of 256 columns"):
        int4_gemm.matmul(torch.zeros(2, 256), words, torch.ones(8, 2), 128)


def test_split_k_depends_on_the_weight_never_on_the_rows() -> None:
    assert int4_gemm.splits(int4_gemm.CONFIG, 72, 512, CPU) == 2  # 2 column tiles, 8 "SMs"
    assert int4_gemm.splits(SPLIT, 72, 768, CPU) == 3
    assert int4_gemm.splits(WHOLE_K, 72, 768, CPU) == 1
    assert "rows" not in int4_gemm.splits.__code__.co_varnames


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `triton_interpret.interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases, x = torch.load(inputs, weights_only=False)
    outs: list[object] = []
    for words, scale, group in cases:
        n, k = words.shape[0], words.shape[1] * 8
        for dtype in (torch.float32, torch.bfloat16):
            outs.append(int4_gemm.dequantize(words, scale, group, torch.empty(n, k, dtype=dtype)))
        for config in TILINGS:
            int4_gemm.reserve(CPU, n, k, config)
            for rows in (1, 7, 7, 31):
                outs.append(int4_gemm.matmul(x[:rows, :k], words, scale, group, config))
    outs.append(bool(int4_gemm._WORKSPACES[CPU][1].any()))
    torch.save(outs, outputs)


def test_triton_kernels_give_the_cpu_paths_weight_and_product(tmp_path: Path) -> None:
    layers = [_layer(72, 768, 128, seed=2), _layer(40, 256, 32, seed=3)]  # 72, 40: partial tiles
    cases = [(int4_gemm.interleave(p.weight_packed, p.in_features), p.weight_scale, p.group_size)
             for p in layers]  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(31, 768, generator=gen).to(torch.bfloat16)
    x[3] *= 100.0
    got = triton_interpret.interpret(__file__, (cases, x), tmp_path)
    assert not got.pop()  # every split-K call reset its counters
    results = iter(got)
    for layer in layers:
        k = layer.in_features
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(next(results), layer.dequantized(dtype))  # bit for bit
        w = layer.dequantized(torch.bfloat16)
        for config in TILINGS:
            one, seven, again, wide = (next(results) for _ in range(4))
            assert one.dtype == torch.bfloat16 and wide.shape == (31, layer.weight_scale.shape[0])
            assert torch.equal(one[0], seven[0]) and torch.equal(seven[:1], wide[:1])  # M-invariant
            assert torch.equal(seven, again)  # deterministic
            assert torch.equal(seven, wide[:7])
            assert int4_gemm.within_tolerance(wide, x[:, :k], w), config
            # the CPU path (dequantize, bf16 matmul) within the same bound of the same product
            assert int4_gemm.within_tolerance(layer(x[:, :k]), x[:, :k], w)


def test_a_cpu_layer_keeps_the_dequantized_path_whatever_is_asked() -> None:
    layer = _layer(16, 128, 128)
    assert layer.kernels == "dequantize"
    assert layer.use_kernels("triton") == "dequantize"
    with pytest.raises(ValueError, match="kernels 'marlin'"):
        layer.use_kernels("marlin")
