"""INT8 W8A8 in one Triton GEMM: int8 x int8 → int32 on the tensor cores (`tl.dot`), the
rescale `(acc * x_scale[m]) * weight_scale[n]` in float32 in the epilogue, the out dtype
written directly: `Int8Linear`'s `kernels="triton"` path (engine/quantization/int8_linear.py).

    y[m, n] = round_out((float(sum_k q_x[m, k] * q_w[n, k]) * x_scale[m]) * w_scale[n])

Integer sums are exact whatever their order, and the two float32 products are the torch
path's in the torch path's order, so the numbers are the CPU path's bit for bit. bf16 output
is rounded to nearest even by integer arithmetic on the float32 bits (what the GPU's
conversion does for finite values; Triton's interpreter truncates in its own conversion, so
with it the CPU tests compare bf16 bit for bit too).

Rows are masked (no padding buffer), and so are columns and the K tail (zeros add nothing);
any M, N, K.

Per M bucket, a config (`CONFIGS`, `config_for`):
- decode (M <= 16): 16-row tiles, narrow column tiles and split-K so the grid fills the SMs;
  the per-token quantization fused into the prologue: each program reads its rows once for
  the amax (max is exact in any order), then quantizes each x tile as it loads it with the
  quantize kernel's arithmetic (IEEE division, half-to-even): one launch a projection.
- small (M <= 64): 64-row tiles, split-K where the tiles do not fill the SMs; x quantized by
  `int8_kernels.quantize_rows` first (two launches).
- prefill: 128 x 256 tiles (8 warps), 3 stages, GROUP_M swizzle so neighbouring programs
  share weight columns in L2; x quantized first (two launches).
Split-K adds int32 partials with atomics into a per-device workspace (exact and order-free);
each tile's programs then bump a counter, and the last one to arrive reads the sum back while
zeroing it (`atomic_xchg`), rescales and writes the output, then resets the counter: the
workspace is zero again after every call, so a CUDA graph replays it without a memset. The
workspace (`reserve`) is made with the layers (never inside a capture) and shared by every
layer on the device: one stream runs them in order.

The default of `Int8Linear` is chosen by the measurement in docs/benchmarks.md, "Quantized
weights (INT8, INT4)" (`python -m benchmarks int --int8-kernels triton,fused,torch`; `--tune`
sweeps these configs and prints the best per bucket). `int8_linear.triton_ready(device)`
checks the kernel against the torch ops once per device and keeps them where it disagrees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.quantization import int8_kernels, triton_device
from engine.quantization.triton_device import triton_unavailable_reason


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tiling of the int8 GEMM."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    """K slices per output tile (1: none; 0: as many as fill the SMs, at most `MAX_SPLIT_K`)."""
    group_m: int
    """Row tiles per swizzle group (1: row-major tile order)."""
    num_warps: int
    num_stages: int
    quantize_in_prologue: bool
    """Quantize x inside the GEMM (one launch) instead of a quantize launch first."""
    swap_ab: bool = False
    """Compute out.T = W @ x.T: W's rows fill the MMA instruction's M (Hopper's wgmma wants
    64), the few rows of x its N (the same integer sums)."""


MAX_SPLIT_K = 16
SPLIT_MAX_ROWS = 64
"""Split-K runs only up to this many rows (the workspace holds this many rows of the widest
projection)."""

CONFIGS: dict[int, GemmConfig] = {
    16: GemmConfig(16, 64, 256, 0, 1, 4, 4, True),
    64: GemmConfig(64, 64, 128, 0, 1, 4, 4, False),
    256: GemmConfig(64, 128, 128, 1, 8, 4, 4, False),
    1 << 62: GemmConfig(128, 256, 128, 1, 8, 8, 3, False),
}
"""{largest M of the bucket: its config}, the buckets in ascending order."""


def config_for(rows: int) -> GemmConfig:
    for top, config in CONFIGS.items():
        if rows <= top:
            return config
    raise AssertionError("the last bucket holds every M")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run for tensors on `device`, or None."""
    return triton_unavailable_reason(device, "the int8 GEMM kernel")


def splits(config: GemmConfig, rows: int, n: int, k: int, device: torch.device) -> int:
    """K slices of `config` for this shape: fixed per shape and device (a CUDA graph's grid)."""
    if rows > SPLIT_MAX_ROWS or config.split_k == 1:
        return 1
    most = max(1, min(MAX_SPLIT_K, k // (2 * config.block_k)))  # two K blocks a slice at least
    if config.split_k:
        return min(config.split_k, most)
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    return triton_device.fill_split(tiles, most, device)


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def reserve(device: torch.device, n: int) -> None:
    """Make `device`'s split-K workspace hold `SPLIT_MAX_ROWS` rows of `n` columns (int32
    partial sums, zero) and a counter per tile of the finest tiling."""
    have = _WORKSPACES.get(device)
    if have is not None and have[0].numel() >= SPLIT_MAX_ROWS * n:
        return
    _WORKSPACES.pop(device, None)
    _WORKSPACES[device] = (
        torch.zeros(SPLIT_MAX_ROWS * n, dtype=torch.int32, device=device),
        torch.zeros(SPLIT_MAX_ROWS * n // 16 + 1, dtype=torch.int32, device=device),
    )


def workspace_bytes(device: torch.device) -> int:
    return triton_device.workspace_bytes(_WORKSPACES, device)


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    divisor: float,
    min_scale: float,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (float) @ weight [N, K] (int8).T with x quantized per token (amax / `divisor`,
    at least `min_scale`, half-to-even, [-128, 127]) and the product rescaled by the token's
    and `weight_scale`'s [N] float32 scales, in `out_dtype` [M, N]. `config`: the bucket's by
    default. Split-K needs the workspace `reserve` made for at least N columns (without it,
    one slice)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"int8 matmul: x has {k} columns, the weight {weight.shape[1]}")
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    config = config or config_for(rows)
    split = splits(config, rows, n, k, x.device)
    tiles = -(-rows // config.block_m) * -(-n // config.block_n)
    ws = _WORKSPACES.get(x.device)
    if split > 1 and (ws is None or ws[0].numel() < rows * n or ws[1].numel() < tiles):
        split = 1
    if split == 1:
        ws = (out, out)  # not read: the kernel's split-K branch is compiled out
    assert ws is not None
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if config.quantize_in_prologue:
        q, x_scale = x, out  # the scales are computed in the kernel
    else:
        q, x_scale = int8_kernels.quantize_rows(x, divisor, min_scale)
    _kernel()[(tiles, split)](
        q, weight, x_scale, weight_scale, out, ws[0], ws[1],
        rows, n, k, q.stride(0), weight.stride(0), divisor, min_scale,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, GROUP_M=config.group_m, QUANTIZE=config.quantize_in_prologue,
        SWAP_AB=config.swap_ab,
        EVEN_K=k % (config.block_k * split) == 0, BF16_OUT=out_dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _kernel() -> Any:
    from engine.quantization import int_gemm_kernels  # imports triton: only where it runs

    return int_gemm_kernels.int8_gemm_kernel
