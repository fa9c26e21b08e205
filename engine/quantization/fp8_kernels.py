"""Triton kernels that write e4m3 directly from the op before an FP8 GEMM (CUDA only).

flashinfer has RMSNorm → e4m3 and add + RMSNorm → e4m3 (engine/modeling/layer_ops.py uses them);
these two cover the other GEMM inputs of a Llama layer:

- `silu_and_mul_quant(x, scale)`: silu(x[:, :I]) * x[:, I:] / scale → e4m3 (down_proj's input)
- `quantize(x, scale)`: x / scale → e4m3 (o_proj's input, attention's output)

and one for an e4m3 KV pool:

- `store_kv(pool_layer, ...)`: k / k_scale and v / v_scale → e4m3 at each token's slot of
  one layer, one launch (instead of a divide, clamp, cast and scatter for K and again for V)

Both compute in float32 and saturate at ±448; `scale` is a float32 device tensor of one
element (read on the device: no host sync, safe inside CUDA-graph capture). One program per
row and column block, so the grid scales with the tokens of the step.

`unavailable_reason()` says why they cannot run here (no triton, no CUDA), or None.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.quantization.fp8_linear import FP8_DTYPE, FP8_MAX

_BLOCK = 1024


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_quant_kernel(
        x_ptr, out_ptr, scale_ptr, inter, x_stride, out_stride, fp8_max, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        inv = 1.0 / tl.load(scale_ptr)
        y = gate / (1.0 + tl.exp(-gate)) * up * inv
        y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def quant_kernel(
        x_ptr, out_ptr, scale_ptr, cols_n, x_stride, out_stride, fp8_max, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < cols_n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * (1.0 / tl.load(scale_ptr))
        y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def store_kv_kernel(
        k_ptr, v_ptr, rows_ptr, blocks_ptr, offsets_ptr, pool_ptr,
        k_stride, v_stride, s_block, s_kv, s_off, inv_k, inv_v, n, fp8_max,
        HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        row = tl.load(rows_ptr + t).to(tl.int64) if HAS_ROWS else t.to(tl.int64)
        block = tl.load(blocks_ptr + t).to(tl.int64)
        off = tl.load(offsets_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dst = pool_ptr + block * s_block + off * s_off + cols
        k = tl.load(k_ptr + row * k_stride + cols, mask=mask, other=0.0).to(tl.float32) * inv_k
        v = tl.load(v_ptr + row * v_stride + cols, mask=mask, other=0.0).to(tl.float32) * inv_v
        k = tl.minimum(tl.maximum(k, -fp8_max), fp8_max)
        v = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
        tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + s_kv, v.to(pool_ptr.dtype.element_ty), mask=mask)

    return silu_mul_quant_kernel, quant_kernel, store_kv_kernel


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _kernels()
    except Exception as e:  # an optional GPU dependency: any failure means "not here"
        return f"triton kernels unavailable: {type(e).__name__}: {e}"
    return None


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return (rows, (cols + _BLOCK - 1) // _BLOCK)


def silu_and_mul_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] / scale in e4m3, for x [T, 2I] with unit column stride."""
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=FP8_DTYPE, device=x.device)
    if rows:
        kernel = _kernels()[0]
        kernel[_grid(rows, inter)](
            x, out, scale, inter, x.stride(0), out.stride(0), FP8_MAX, BLOCK=_BLOCK
        )
    return out


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3 for x [T, N] with unit column stride."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    if rows:
        kernel = _kernels()[1]
        kernel[_grid(rows, cols)](
            x, out, scale, cols, x.stride(0), out.stride(0), FP8_MAX, BLOCK=_BLOCK
        )
    return out


def store_kv(
    pool: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: tuple[float, float],
    rows: torch.Tensor | None = None,
) -> None:
    """pool[slot_blocks[t], 0/1, slot_offsets[t]] = k/v[rows[t] or t] / scale in e4m3.

    `pool`: one layer's view of an e4m3 pool [blocks, 2, block_size, Hkv, D] whose token's
    heads are one run (block- or layer-major, `KVCache.layer`); k, v [T, Hkv, D] with
    contiguous heads (views into the qkv projection are fine)."""
    t = slot_blocks.shape[0]
    if t == 0:
        return
    n = k.shape[1] * k.shape[2]
    if any(x.stride(2) != 1 or x.stride(1) != x.shape[2] for x in (k, v, pool[:, 0, 0])):
        raise ValueError("store_kv: k, v and the pool need contiguous heads")
    kernel = _kernels()[2]
    import triton  # imports: _kernels() built the kernels with it

    kernel[(t,)](
        k, v, rows if rows is not None else slot_blocks, slot_blocks, slot_offsets, pool,
        k.stride(0), v.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        1.0 / scales[0], 1.0 / scales[1], n, FP8_MAX,
        HAS_ROWS=rows is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
