"""Int4 weights in PyTorch's tinygemm layout dequantized to bf16: the large-M path of
`Int4Linear` (engine/quantization/int4_linear.py).

tinygemm (`torch._weight_int4pack_mm`) reads the whole int4 weight once per 16-row tile of
the input, so its time grows with the rows: good for decode, 17x the bf16 time for a 4096-token
prefill. Past a row threshold the layer instead writes W in bf16 once into a shared
workspace and runs the bf16 GEMM (cuBLAS), reading the weight's int4 bytes once per call.

The layout (`torch._convert_weight_to_int4pack` on CUDA with 8 inner k-tiles, the kernel
`matrix_to_m16n8k16_Bint4_layout`): int32 [N / 8, K / 128, 32, 4]; word (nt, ko, lane, w),
lane = 4 * tn + tk, holds eight unsigned nibbles u (W's int4 value is u - 8), nibble
i = 4c + 2a + b (bits 4i .. 4i + 3) being

    W[8 nt + tn, 128 ko + 32 w + 16 a + 8 b + 2 tk + c]

`encode_tinygemm` writes that layout in torch ops (what the CUDA kernel computes; the GPU
test compares them), `decode_tinygemm` reads it back; `layout_verified(device)` checks once
per device that the installed PyTorch still writes it, and `Int4Linear` keeps tinygemm for
every size where it does not.

`dequantize(packed, scale, group_size, out)`: W = q * scale in float32, rounded to out's
dtype, one Triton launch (CUDA, or Triton's interpreter), else torch ops: the numbers of the
CPU path's dequantized weight exactly. The workspace (`reserve`, `workspace`) is one buffer
per device, as large as the largest projection, made when the layers are built (never inside
a CUDA-graph capture) and reused by every layer in turn (one stream runs them in order).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine.quantization.triton_device import triton_unavailable_reason

log = logging.getLogger(__name__)

N_TILE, K_TILE = 8, 128
"""Rows and columns of one tinygemm tile (8 inner k-tiles of 16)."""
_BLOCK_N, _BLOCK_K = 32, 128
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def encode_tinygemm(q: torch.Tensor) -> torch.Tensor:
    """int32 [N / 8, K / 128, 32, 4] of int values q [N, K] in [-8, 7] (module docstring)."""
    n, k = q.shape
    u = (q.to(torch.int64) + 8).view(n // N_TILE, 8, k // K_TILE, 4, 2, 2, 4, 2)
    # [nt, tn, ko, w, a, b, tk, c] -> [nt, ko, tn, tk, w, c, a, b]
    nibbles = u.permute(0, 2, 1, 6, 3, 7, 4, 5).reshape(n // N_TILE, k // K_TILE, 32, 4, 8)
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def decode_tinygemm(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] of `encode_tinygemm`'s layout."""
    nt, ko = packed.shape[:2]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    u = ((packed.unsqueeze(-1) >> shifts) & 0xF).view(nt, ko, 8, 4, 4, 2, 2, 2)
    # [nt, ko, tn, tk, w, c, a, b] -> [nt, tn, ko, w, a, b, tk, c]
    w = u.permute(0, 2, 1, 4, 6, 7, 3, 5).reshape(nt * N_TILE, ko * K_TILE)
    return (w - 8).to(torch.int8)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, out: torch.Tensor
) -> torch.Tensor:
    """W [N, K] = q * scale (float32 scale [N, K / group_size]) in out's dtype, written into
    `out` (contiguous, N * K elements); returns out."""
    n, k = packed.shape[0] * N_TILE, packed.shape[1] * K_TILE
    if out.shape != (n, k) or not out.is_contiguous():
        raise ValueError(f"dequantize: want a contiguous [{n}, {k}] output, got {out.shape}")
    if unavailable_reason(packed.device) is not None:
        q = decode_tinygemm(packed).float().view(n, -1, group_size)
        return out.copy_((q * scale.unsqueeze(-1)).view(n, k))
    grid = (n // _BLOCK_N, k // _BLOCK_K)
    _kernel()[grid](
        packed, scale, out, k, scale.shape[1], group_size, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K
    )
    return out


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run for tensors on `device`, or None."""
    return triton_unavailable_reason(device, "the int4 dequantize kernel")


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_kernel(
        packed_ptr, scale_ptr, out_ptr, K, groups, group_size,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        r = k % 128  # column within the tile: 32 w + 16 a + 8 b + 2 tk + c
        lane = (n % 8) * 4 + (r // 2) % 4
        word = (((n // 8) * (K // 128) + k // 128) * 32 + lane) * 4 + r // 32
        shift = 4 * (4 * (r % 2) + 2 * ((r // 16) % 2) + (r // 8) % 2)
        u = (tl.load(packed_ptr + word) >> shift) & 0xF
        s = tl.load(scale_ptr + n * groups + k // group_size)
        w = (u - 8).to(tl.float32) * s
        tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty))

    return dequant_kernel


def fits(out_features: int, in_features: int) -> bool:
    """Whether the kernel's blocks tile this weight (tinygemm's own shapes: out a multiple of
    8, in of 128; the kernel's row block is 32)."""
    return out_features % _BLOCK_N == 0 and in_features % K_TILE == 0


@functools.cache
def layout_verified(device: torch.device) -> bool:
    """Whether this PyTorch's `_convert_weight_to_int4pack` on `device` writes the layout
    above, and the dequantize kernel reads it back exactly (once per device, on a probe)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (2 * _BLOCK_N, 2 * K_TILE), generator=gen, dtype=torch.int8)
    scale = torch.rand(q.shape[0], 2, generator=gen) + 0.5
    try:
        u = (q.to(torch.int32) + 8).to(torch.uint8).to(device)
        packed = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).contiguous(), 8)
        want = (q.float().view(q.shape[0], 2, -1) * scale.unsqueeze(-1)).view(q.shape)
        out = torch.empty(q.shape, dtype=torch.float32, device=device)
        got = dequantize(packed, scale.to(device), K_TILE, out).cpu()
    except Exception as e:  # a PyTorch without the op, a kernel that does not build
        log.warning("int4: no dequantized large-M path (%s: %s)", type(e).__name__, e)
        return False
    if not torch.equal(got, want):
        log.warning("int4: tinygemm's layout is not the one dequantize reads; tinygemm only")
        return False
    return True


def reserve(device: torch.device, numel: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Make the workspace of `device` hold at least `numel` elements of `dtype`."""
    have = _WORKSPACES.get(device)
    if have is None or have.numel() < numel or have.dtype != dtype:
        _WORKSPACES.pop(device, None)  # free the smaller one first
        _WORKSPACES[device] = torch.empty(numel, dtype=dtype, device=device)


def workspace(device: torch.device, rows: int, cols: int) -> torch.Tensor:
    """The workspace of `device` as a [rows, cols] view (`reserve` made it large enough)."""
    return _WORKSPACES[device][: rows * cols].view(rows, cols)


def workspace_bytes(device: torch.device) -> int:
    """Bytes of `device`'s workspace (0: none)."""
    have = _WORKSPACES.get(device)
    return 0 if have is None else have.numel() * have.element_size()
