"""INT4 W4A16 in Triton: a GEMM for decode-sized inputs that reads the int4 weight once and
multiplies in bf16, and the dequantize of the same layout for the large-M path: `Int4Linear`'s
`kernels="triton"` (engine/quantization/int4_linear.py).

The layout (`interleave`, made once at load from compressed-tensors' pack-quantized words):
int32 [N, K / 8] like the checkpoint's, row n's words K-major, but within each span of 128
columns (16 words) word j holds the columns 16 i + j in its nibbles i = 0..7 (bits 4i .. 4i+3,
stored as q + 8). A program loads a [BLOCK_N, 16] tile of words per span (64 contiguous bytes
a row: 128-bit loads, coalesced), and nibble i of every word is the contiguous 16-column chunk
16 i .. 16 i + 15: eight `tl.dot`s of K 16 with no shuffle of registers. K must be a multiple
of 128 and the group a multiple of 16 (a chunk never straddles two groups).

    matmul      y = x @ W.T for bf16 x [M, K]: each chunk dequantized in registers as the CPU
                path does (q * scale in float32, rounded to bf16 nearest even), `tl.dot` with
                float32 accumulation (rows padded to BLOCK_M in the tile), bf16 out. One
                config for every M (`CONFIG`): a row's numbers do not depend on how many rows
                share the call. Split-K where the column tiles do not fill the SMs: each K
                slice writes its float32 partial to a per-device workspace [splits, M, N], the
                last slice of a tile to arrive (a counter, reset by it) sums the partials in
                slice order: deterministic, no float atomics. Fixed grid per shape, no host
                sync, no allocation but the output: a CUDA graph replays it. (Under Triton's
                interpreter, the CPU tests, the dot takes the bf16 operands widened to float32,
                exactly: its own bf16 dot multiplies the raw bits.)
    dequantize  W [N, K] = q * scale in float32, rounded to the output's dtype: the CPU path's
                dequantized weight exactly (the large-M path's bf16 GEMM operand)

The default of `Int4Linear` is chosen by the measurement in docs/benchmarks.md, "Quantized
weights (INT8, INT4)" (`python -m benchmarks int --int4-kernels triton,tinygemm`; `--tune`
sweeps `GemmConfig`s). `triton_ready(device)` checks both kernels once per device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from engine.quantization import triton_device
from engine.quantization.triton_device import DecidedOnce, triton_unavailable_reason

log = logging.getLogger(__name__)

SPAN = 128
"""Columns per interleaved block (16 int32 words)."""
_WORDS = SPAN // 8
_CHUNK = SPAN // 8
"""Columns per nibble position in a span: one `tl.dot` of this K."""


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tiling of the W4A16 GEMM."""

    block_m: int
    block_n: int
    spans: int
    """Spans (128 columns) per loop iteration."""
    split_k: int
    """K slices per column tile (1: none; 0: as many as fill the SMs, at most `MAX_SPLIT_K`)."""
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    """Compute out.T = W @ x.T: W's rows fill the MMA instruction's M (Hopper's wgmma wants
    64, and takes A from registers: the dequantized tile goes straight in), x's its N."""


MAX_SPLIT_K = 16
MAX_ROWS = 64
"""Rows the split-K workspace holds (more rows: one slice, so a row's numbers are the same at
every batch up to this many rows; `Int4Linear` runs the kernel below `INT4_LARGE_M_ROWS`)."""
CONFIG = GemmConfig(32, 64, 1, 0, 4, 4)
"""The tiling of every call (a fixed one: the rows of a batch never change a row's result)."""


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether this weight can take the layout (module docstring)."""
    return in_features % SPAN == 0 and group_size % _CHUNK == 0 and out_features > 0


def interleave(packed: torch.Tensor, in_features: int, rows_at_once: int = 2048) -> torch.Tensor:
    """The layout of compressed-tensors' pack-quantized words [N, K / 8] (column 8 j + i in
    nibble i of word j): int32 [N, K / 8] (module docstring), on packed's device, made
    `rows_at_once` rows at a time (the int64 temporaries of a whole 70B projection: ~2 GB)."""
    n = packed.shape[0]
    out = torch.empty((n, in_features // 8), dtype=torch.int32, device=packed.device)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    for lo in range(0, n, rows_at_once):
        part = packed[lo : lo + rows_at_once]
        nibbles = ((part.unsqueeze(-1) >> shifts) & 0xF).reshape(part.shape[0], in_features)
        out[lo : lo + rows_at_once] = interleave_nibbles(nibbles)
    return out


def interleave_nibbles(u: torch.Tensor) -> torch.Tensor:
    """The layout of unsigned nibbles u = q + 8 [N, K]: int32 [N, K / 8]."""
    n, k = u.shape
    shifts = torch.arange(8, device=u.device, dtype=torch.int64) * 4
    # u[n, s, i, j] is column 128 s + 16 i + j: word j of span s gets it in nibble i
    spans = u.to(torch.int64).reshape(n, k // SPAN, 8, _WORDS).transpose(2, 3)
    words = (spans << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(n, -1)


def deinterleave(words: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] of `interleave`'s layout."""
    n, k = words.shape[0], words.shape[1] * 8
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    u = (words.view(n, k // SPAN, _WORDS).unsqueeze(-1) >> shifts) & 0xF  # [n, s, j, i]
    return (u.transpose(2, 3).reshape(n, k) - 8).to(torch.int8)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run for tensors on `device`, or None."""
    return triton_unavailable_reason(device, "the int4 GEMM kernels")


def splits(config: GemmConfig, n: int, k: int, device: torch.device) -> int:
    """K slices of `config` for a weight [n, k]: fixed per shape and device, never per M."""
    if config.split_k == 1:
        return 1
    most = max(1, min(MAX_SPLIT_K, k // (2 * SPAN * config.spans)))
    if config.split_k:
        return min(config.split_k, most)
    tiles = -(-n // config.block_n)
    return triton_device.fill_split(tiles, most, device)


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def reserve(device: torch.device, n: int, k: int, config: GemmConfig | None = None) -> None:
    """Make `device`'s split-K workspace hold the partials of `MAX_ROWS` rows of a weight
    [n, k] under `config` (default `CONFIG`) and a counter per tile."""
    config = config or CONFIG
    split = splits(config, n, k, device)
    if split == 1:
        return
    partials = split * MAX_ROWS * n
    counters = -(-MAX_ROWS // config.block_m) * -(-n // config.block_n)
    have = _WORKSPACES.get(device)
    if have is not None:
        if have[0].numel() >= partials and have[1].numel() >= counters:
            return
        partials, counters = max(partials, have[0].numel()), max(counters, have[1].numel())
    _WORKSPACES.pop(device, None)
    _WORKSPACES[device] = (
        torch.empty(partials, dtype=torch.float32, device=device),
        torch.zeros(counters, dtype=torch.int32, device=device),  # zero between calls
    )


def workspace_bytes(device: torch.device) -> int:
    return triton_device.workspace_bytes(_WORKSPACES, device)


def matmul(
    x: torch.Tensor,
    words: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """bf16 [M, N] = x [M, K] (bf16) @ W.T, W in `interleave`'s layout with float32 group
    scales [N, K / group_size] (module docstring). Split-K needs `reserve` for this weight
    (without it, one slice)."""
    rows, k = x.shape
    n = words.shape[0]
    if words.shape[1] * 8 != k or x.dtype != torch.bfloat16:
        raise ValueError(f"int4 matmul: want bf16 x of {words.shape[1] * 8} columns, got "
                         f"{x.dtype} [{rows}, {k}]")  # fmt: skip
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    if rows == 0:
        return out
    config = config or CONFIG
    split = splits(config, n, k, x.device)
    tiles_m, tiles_n = -(-rows // config.block_m), -(-n // config.block_n)
    ws = _WORKSPACES.get(x.device)
    # whether the workspace fits is asked for MAX_ROWS rows, never for this call's: a row's
    # numbers must not depend on the batch
    most_tiles = -(-MAX_ROWS // config.block_m) * tiles_n
    if split > 1 and (
        rows > MAX_ROWS
        or ws is None
        or ws[0].numel() < split * MAX_ROWS * n
        or ws[1].numel() < most_tiles
    ):
        split = 1
    if split == 1:
        ws = (out, out)  # not read: the kernel's split-K branch is compiled out
    assert ws is not None
    x = x if x.stride(1) == 1 else x.contiguous()
    _kernels()[0][(tiles_n, split, tiles_m)](
        x, words, scale, out, ws[0], ws[1], rows, n, k, x.stride(0), scale.shape[1],
        GROUP=group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPANS=config.spans,
        SPLIT_K=split, SWAP_AB=config.swap_ab, INTERPRET=x.device.type != "cuda",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


_DEQUANT_BLOCK_N = 32


def dequantize(
    words: torch.Tensor, scale: torch.Tensor, group_size: int, out: torch.Tensor
) -> torch.Tensor:
    """W [N, K] = q * scale (float32 scale [N, K / group_size]) in out's dtype, written into
    `out` (contiguous [N, K]); returns out. Torch ops where Triton cannot run."""
    n, k = words.shape[0], words.shape[1] * 8
    if out.shape != (n, k) or not out.is_contiguous():
        raise ValueError(f"dequantize: want a contiguous [{n}, {k}] output, got {out.shape}")
    if unavailable_reason(words.device) is not None:
        q = deinterleave(words).float().view(n, -1, group_size)
        return out.copy_((q * scale.unsqueeze(-1)).view(n, k))
    grid = (-(-n // _DEQUANT_BLOCK_N), k // SPAN)
    _kernels()[1][grid](
        words, scale, out, n, k, scale.shape[1], group_size, BLOCK_N=_DEQUANT_BLOCK_N,
        BF16_OUT=out.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def _kernels() -> tuple[Any, Any]:
    from engine.quantization import int_gemm_kernels  # imports triton: only where it runs

    return int_gemm_kernels.int4_gemm_kernel, int_gemm_kernels.int4_dequant_kernel


def verified(device: torch.device) -> bool:
    """Whether, on `device`, the dequantize kernel writes the CPU path's bf16 weight bit for
    bit and the GEMM lies within `tolerance` of a float64 product of the same bf16 operands,
    with row 0 identical at 1 and 7 rows and from one call to the next (a probe whose columns
    are no multiple of the tile, split-K and not)."""
    gen = torch.Generator().manual_seed(0)
    n, k, group = 200, 1024, 128
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) / 50 + 1e-3
    x = torch.randn(7, k, generator=gen).to(torch.bfloat16)
    w = (q.float().view(n, -1, group) * scale.unsqueeze(-1)).view(n, k).to(torch.bfloat16)
    try:
        words = interleave_nibbles(q + 8).to(device)
        dev_scale = scale.to(device)
        out = torch.empty(n, k, dtype=torch.bfloat16, device=device)
        if not torch.equal(dequantize(words, dev_scale, group, out).cpu(), w):
            log.warning("int4: the Triton dequantize differs from the CPU weight; tinygemm")
            return False
        for config in (CONFIG, dataclasses.replace(CONFIG, split_k=1)):
            reserve(device, n, k, config)
            one = matmul(x[:1].to(device), words, dev_scale, group, config).cpu()
            seven = matmul(x.to(device), words, dev_scale, group, config).cpu()
            again = matmul(x.to(device), words, dev_scale, group, config).cpu()
            if not (torch.equal(one[0], seven[0]) and torch.equal(seven, again)):
                log.warning("int4: the Triton GEMM's rows depend on the batch or the run")
                return False
            if not within_tolerance(seven, x, w):
                log.warning("int4: the Triton GEMM is off the bf16 product; tinygemm")
                return False
    except Exception as e:  # a kernel that does not build here
        log.warning("int4: no Triton GEMM (%s: %s); tinygemm", type(e).__name__, e)
        return False
    return True


def within_tolerance(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether bf16 `got` = x @ w.T to bf16 GEMM precision (`product_bound`)."""
    exact, bound = product_bound(x.cpu(), w.cpu())
    return bool(((got.double().cpu() - exact).abs() <= bound).all())


def product_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) of x @ w.T for bf16 operands, on their device: the float64 product and
    how far a bf16 GEMM's output may lie from it, 2^-8 |exact| (the output's rounding, half an
    ulp being 2^-9) + K 2^-24 (|x| @ |w|.T) (float32 accumulation's error bound)."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.t()
    return exact, exact.abs() * 2**-8 + xd.shape[1] * 2**-24 * (xd.abs() @ wd.abs().t())


triton_ready = DecidedOnce(lambda device: unavailable_reason(device) is None and verified(device))
"""Whether `Int4Linear` may take this layout on a device (`DecidedOnce`)."""
