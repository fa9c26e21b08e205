"""The CUDA path of `Int8Linear` in three launches instead of about sixteen.

In torch ops, a projection's per-token quantization is a chain of elementwise kernels (to
float32, abs, amax, divide, clamp, divide, round, clamp, to int8), the `_int_mm` input below 17
rows is padded by two more (zeros, copy), and the rescale is four (to float32, times the token
scales, times the channel scales, to the out dtype). A Llama-3-8B decode step runs four such
projections in each of 32 layers: ~2,000 small kernels, each a node of the CUDA graph, which
cost more than the halved weight bytes save (docs/benchmarks.md, "Quantized weights (INT8,
INT4)": INT8 decode 1.25x bf16's step on an H100). Here:

    quantize_rows   one program per row: amax, the row's scale and its int8 values, written
                    into a buffer of at least `min_rows` rows whose extra rows are zero (the
                    padding `torch._int_mm` wants)
    torch._int_mm   int8 x int8 → int32 (cuBLASLt), unchanged
    rescale         int32 * token scale * channel scale in float32, rounded to the out dtype

Both kernels compute the torch path's numbers exactly: the scale is amax / 127.5 in IEEE
division (`tl.div_rn`; Triton's `/` may round differently), the value x / scale likewise, then
round-half-even and clamp; the rescale multiplies in the torch path's order.
`int8_linear.fused_verified(device)` checks that once per device on a probe with ties and a
zero row, and `Int8Linear` keeps the torch ops where it does not hold or Triton is missing.
Triton's interpreter runs both on CPU (the unit tests compare them with the torch ops there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.quantization.triton_device import triton_unavailable_reason

_BLOCK_COLS = 1024
"""Columns a quantize program reads at a time (two passes over its row: amax, then values)."""
_BLOCK_M, _BLOCK_N = 16, 128


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run for tensors on `device`, or None."""
    return triton_unavailable_reason(device, "the int8 kernels")


def quantize_rows(
    x: torch.Tensor, divisor: float, min_scale: float, min_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [max(rows, min_rows), cols], float32 scales [rows, 1]) of x [rows, cols]: each
    row by its own amax / `divisor` (at least `min_scale`), rounded half-to-even and clamped
    to [-128, 127]; rows past x's are zero."""
    rows, cols = x.shape
    x = x.contiguous()
    q = torch.empty((max(rows, min_rows), cols), dtype=torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if q.shape[0]:
        import triton

        block = min(_BLOCK_COLS, triton.next_power_of_2(cols))
        # one program per row of q: the padding rows past x's write zeros
        _quantize_kernel()[(q.shape[0],)](x, q, scale, rows, cols, divisor, min_scale, BLOCK=block)
    return q, scale


def rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, rows: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """(acc[:rows] in float32 * x_scale * w_scale) in `out_dtype`: acc int32 [>= rows, N],
    x_scale float32 [rows, 1], w_scale float32 [N]."""
    n = acc.shape[1]
    out = torch.empty((rows, n), dtype=out_dtype, device=acc.device)
    if rows:
        import triton

        grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
        _rescale_kernel()[grid](
            acc, x_scale, w_scale, out, rows, n, acc.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N
        )
    return out


@functools.cache
def _quantize_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(
        x_ptr, q_ptr, scale_ptr, rows, cols, divisor, min_scale, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if row >= rows:  # a padding row
            for start in range(0, cols, BLOCK):
                m = start + offs < cols
                tl.store(q_ptr + row * cols + start + offs, tl.zeros((BLOCK,), tl.int8), mask=m)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, cols, BLOCK):
                m = start + offs < cols
                x = tl.load(x_ptr + row * cols + start + offs, mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), divisor), min_scale)
            tl.store(scale_ptr + row, scale)
            for start in range(0, cols, BLOCK):
                m = start + offs < cols
                x = tl.load(x_ptr + row * cols + start + offs, mask=m, other=0.0).to(tl.float32)
                v = tl.div_rn(x, scale)
                r = tl.floor(v + 0.5)  # half-to-even: a tie rounded up to an odd value goes down
                r = tl.where((r - v == 0.5) & (r % 2 != 0), r - 1.0, r)
                r = tl.minimum(tl.maximum(r, -128.0), 127.0)
                tl.store(q_ptr + row * cols + start + offs, r.to(tl.int8), mask=m)

    return quantize_kernel


@functools.cache
def _rescale_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rescale_kernel(
        acc_ptr, xs_ptr, ws_ptr, out_ptr, rows, n, acc_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        m = (r < rows) & (c < n)
        acc = tl.load(acc_ptr + r * acc_stride + c, mask=m, other=0).to(tl.float32)
        xs = tl.load(xs_ptr + r, mask=r < rows, other=0.0)
        ws = tl.load(ws_ptr + c, mask=c < n, other=0.0)
        out = acc * xs * ws  # (acc * xs) * ws: the torch path's order
        tl.store(out_ptr + r * n + c, out.to(out_ptr.dtype.element_ty), mask=m)

    return rescale_kernel
