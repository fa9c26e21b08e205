"""The int4 large-M path's pieces on CPU (engine/quantization/int4_kernels.py): the tinygemm
layout written and read back in torch ops, the Triton dequantize kernel in Triton's
interpreter against them, and `Int4Linear`'s dequantized weight made where its scales live.
On a GPU (tests/gpu/test_int_gpu.py): the layout against `_convert_weight_to_int4pack`, the
large-M path against the CPU path, inside a CUDA graph too."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton_interpret

from engine.quantization import int4_kernels
from engine.quantization.int4_linear import Int4Linear, pack_int4, quantize_groups_int4


def _q(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)


def test_tinygemm_layout_places_each_value_where_the_cuda_kernel_reads_it() -> None:
    q = _q(16, 256)
    packed = int4_kernels.encode_tinygemm(q)
    assert packed.shape == (2, 2, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(int4_kernels.decode_tinygemm(packed), q)
    # word (nt 1, ko 1, lane 4 tn + tk = 4 * 3 + 2, w 1), nibble 4c + 2a + b = 4 + 2 + 0:
    # W[8 + 3, 128 + 32 + 16 + 0 + 2 * 2 + 1]
    word = int(packed[1, 1, 14, 1]) & 0xFFFFFFFF
    assert (word >> 24) & 0xF == int(q[11, 181]) + 8


def test_dequantize_without_triton_is_the_cpu_paths_weight() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_groups_int4(w, 64)
    cpu = Int4Linear(pack_int4(q), scale, 256, 64, None)
    out = torch.empty(64, 256)
    int4_kernels.dequantize(int4_kernels.encode_tinygemm(q), scale, 64, out)
    assert torch.equal(out, cpu.dequantized(torch.float32))


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `triton_interpret.interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = torch.load(inputs, weights_only=False)
    outs = []
    for packed, scale, group_size, dtype in cases:
        out = torch.empty(packed.shape[0] * 8, packed.shape[1] * 128, dtype=dtype)
        outs.append(int4_kernels.dequantize(packed, scale, group_size, out))
    torch.save(outs, outputs)


def test_triton_dequantize_kernel_writes_the_weight(tmp_path: Path) -> None:
    cases, want = [], []
    for rows, cols, group_size, dtype in (
        (64, 256, 128, torch.float32),
        (96, 384, 32, torch.bfloat16),
    ):
        q = _q(rows, cols, seed=rows)
        scale = torch.rand(rows, cols // group_size, generator=torch.Generator().manual_seed(2))
        cases.append((int4_kernels.encode_tinygemm(q), scale, group_size, dtype))
        full = q.float().view(rows, -1, group_size) * scale.unsqueeze(-1)
        want.append(full.view(rows, cols).to(dtype))
    got = triton_interpret.interpret(__file__, cases, tmp_path)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0])
    # the interpreter truncates float32 -> bf16 (the GPU rounds to nearest even, exactly the
    # CPU path's weight: tests/gpu/test_int_gpu.py): within one bf16 step here
    assert got[1].dtype == torch.bfloat16
    step = want[1].float().abs() * 2**-7
    assert bool(((got[1].float() - want[1].float()).abs() <= step).all())


def test_int4_dequantized_weight_is_made_on_the_scales_device() -> None:
    """A CUDA layer keeps its packed weight on the host and its scales on the device: the
    dequantized weight is computed there (meta stands in for the device)."""
    q, scale = quantize_groups_int4(torch.randn(16, 128), 128)
    layer = Int4Linear(pack_int4(q), scale, 128, 128, None)
    assert layer.large_m_rows is None  # CPU: no tinygemm, no workspace
    layer.weight_scale = layer.weight_scale.to("meta")
    got = layer.dequantized(torch.bfloat16)
    assert got.device.type == "meta" and got.shape == (16, 128) and got.dtype == torch.bfloat16
