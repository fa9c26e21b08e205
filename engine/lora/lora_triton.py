"""Triton kernels of the LoRA graph step, the punica/S-LoRA "BGMV" way: each token reads the
weights of its own slot, so the work does not grow with the number of slots.

Two launches per fused projection, whatever its parts (q/k/v, gate/up):

- shrink, grid (tokens, parts, k splits): program (t, p, s) loads token t's slot (-1: base;
  the program then stops, having read no weights) and computes x[t, K_s] @ A[slot, p, :, K_s]^T
  over its span K_s of the fan-in, BLOCK_K columns at a time, in fp32, into
  h[s, t, p, :rank]. The fan-in is split so that a small batch still fills the GPU (fan-in
  8192 or 28672 at B=1); the expand sums the splits, so there are no atomics and no zeroing.
  A program's number of BLOCK_K steps is a compile-time power of two (`fan_in_split`), its
  loop unrolled: no loop has runtime bounds, which Triton 3.6's interpreter cannot run
  under NumPy 2.4 (int() of a 1-element array), and few variants compile.
- expand, grid (tokens, column blocks): every part has its own BLOCK_N-wide column blocks
  (a block never straddles two parts; the last one of a part is masked), part 0's first, then
  part 1's, then part 2's. Program (t, j) finds its part by counting blocks, sums h[:, t, p]
  over the splits and adds h @ B_p[slot][:, block] to out[t, lo_p + block] in fp32, rounding
  once into out's dtype (in place; base tokens' rows are neither read nor written).

Grid and buffer shapes depend only on the number of tokens and the model's dims, never on the
slots, and nothing syncs with the host: a CUDA graph captured once holds for any slot values.
The expand takes up to `MAX_PARTS` parts as separate pointer arguments (unused ones repeat part
0 and get no blocks); the weights are views of `LoraWeights`, never copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_PARTS = 3
"""Parts of one fused projection the expand handles (qkv's three)."""
MAX_K_STEPS = 8
"""BLOCK_K steps of one shrink program at most (unrolled); more fan-in means more splits."""
TARGET_PROGRAMS = 1024
"""Shrink programs the fan-in split aims at (a few per SM of an H100/H200)."""
_SHRINK_TILE = 8192
"""Elements of one shrink tile (BLOCK_R x BLOCK_K)."""
_EXPAND_TILE = 4096
"""Elements of one expand tile (BLOCK_R x BLOCK_N)."""


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one projection's launches (powers of two, BLOCK_R >= the rank)."""

    block_r: int
    block_k: int
    block_n: int
    split_k: int | None = None
    """Fan-in splits to aim at; None: enough for `TARGET_PROGRAMS` shrink programs."""


def default_tiles(rank: int) -> Tiles:
    """Tiles of a slot rank: BLOCK_R the next power of two, the tiles' elements fixed."""
    block_r = max(16, triton.next_power_of_2(rank))
    return Tiles(block_r, _SHRINK_TILE // block_r, max(16, _EXPAND_TILE // block_r))


@dataclass(frozen=True)
class FanInSplit:
    """How the shrink splits the fan-in: `splits` programs per (token, part), each over
    `k_steps` (a power of two) blocks of BLOCK_K columns; the last may end past the fan-in."""

    k_steps: int
    splits: int


def fan_in_split(num_tokens: int, num_parts: int, fan_in: int, tiles: Tiles) -> FanInSplit:
    """The split of `fan_in` for a launch over `num_tokens` x `num_parts` (from the shapes
    only; powers of two keep the number of compiled variants small)."""
    blocks = triton.cdiv(fan_in, tiles.block_k)
    want = tiles.split_k or triton.cdiv(TARGET_PROGRAMS, max(1, num_tokens * num_parts))
    k_steps = min(MAX_K_STEPS, triton.next_power_of_2(triton.cdiv(blocks, max(1, want))))
    return FanInSplit(k_steps, triton.cdiv(blocks, k_steps))


SHRINKS = ("dense", "bgmv", "dot")
"""How `add_lora` shrinks and expands: "dense", one matmul of x against every slot's A at once
(the expand then reads only the token's own slot's columns: no mask); "bgmv", a Triton program
per token reading only its slot's A; "dot", engine/lora/lora_dot.py: the dense shrink, then a
tensor-core expand that reads every slot's B once per tile of tokens, masking each token's
other slots in registers (the per-token expands re-read B for every token)."""
DEFAULT_SHRINK = "dot"
"""H200, `python -m benchmarks lora` (Llama-3-8B, B=64 decode, rank 16 on all seven
projections, CUDA graphs): "dot" made the step 1.218x the base model's with 16 slots and
1.155x with 4 (1.120x and 1.065x with its shrink beside the base GEMM, `LoraStep.begin`); the
per-token expands after either other shrink 1.46-1.49x."""


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    columns: Sequence[tuple[int, int]],
    tiles: Tiles | None = None,
    shrink: str | None = None,
) -> None:
    """out[t, lo_p:hi_p] += (x[t] @ a[p, slots[t]]^T) @ b[p][slots[t]] for every part p and
    every token t with slots[t] >= 0 (in place; other rows untouched). Two launches.

    x: [tokens, in]; out: [tokens, >= hi of the last part]; slots: [tokens] int32/int64;
    a: [parts, rows, rank, in]; b[p]: [rows, rank, hi_p - lo_p] (last dim contiguous);
    columns[p]: (lo_p, hi_p); shrink: one of `SHRINKS` (None: `DEFAULT_SHRINK`).
    """
    shrink = shrink or DEFAULT_SHRINK
    num_parts, rows, rank, fan_in = a.shape
    if not 1 <= num_parts <= MAX_PARTS or len(b) != num_parts or len(columns) != num_parts:
        raise ValueError(f"1 to {MAX_PARTS} parts with one B and one column range each")
    if any(bp.stride(2) != 1 for bp in b) or slots.dim() != 1 or not slots.is_contiguous():
        raise ValueError("B's columns and the slots must be contiguous")
    if shrink not in SHRINKS:
        raise ValueError(f"shrink: one of {', '.join(SHRINKS)}, got {shrink!r}")
    t = x.shape[0]
    if t == 0:
        return
    tiles = tiles or default_tiles(rank)
    if shrink == "dot":
        from engine.lora.lora_dot import add_lora_dot

        add_lora_dot(x, out, slots, a, b, columns)
        return
    if shrink == "dense":  # h[0, t, p, slot * rank + r]: every slot's, the expand picks one
        dense = torch.nn.functional.linear(x, a.reshape(-1, fan_in))
        h = dense.view(1, t, num_parts, rows * rank)
        splits, slot_stride = 1, rank
    else:
        split = fan_in_split(t, num_parts, fan_in, tiles)
        splits, slot_stride = split.splits, 0
        h = torch.empty((splits, t, num_parts, rank), dtype=torch.float32, device=x.device)
        _shrink_kernel[(t, num_parts, splits)](
            x, a, h, slots, fan_in, rank,
            x.stride(0), x.stride(1),
            a.stride(0), a.stride(1), a.stride(2), a.stride(3),
            h.stride(0), h.stride(1), h.stride(2),
            BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, K_STEPS=split.k_steps,
        )  # fmt: skip
    widths = [hi - lo for lo, hi in columns]
    blocks = [triton.cdiv(w, tiles.block_n) for w in widths]
    pad = MAX_PARTS - num_parts
    bs = [*b, *[b[0]] * pad]
    los = [lo for lo, _ in columns] + [0] * pad
    widths += [0] * pad
    _expand_kernel[(t, sum(blocks))](
        h, out, slots, *bs, *los, *widths, blocks[0], blocks[1] if num_parts > 1 else 0,
        bs[0].stride(0), bs[0].stride(1), bs[1].stride(0), bs[1].stride(1),
        bs[2].stride(0), bs[2].stride(1),
        rank, splits, h.stride(0), h.stride(1), h.stride(2), slot_stride,
        out.stride(0), out.stride(1),
        BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, BLOCK_S=triton.next_power_of_2(splits),
    )  # fmt: skip


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr, fan_in, rank,
    stride_xt, stride_xk,
    stride_ap, stride_as, stride_ar, stride_ak,
    stride_hs, stride_ht, stride_hp,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    part = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        k = tl.arange(0, BLOCK_K)
        in_r = r < rank
        a_rows = a_ptr + part * stride_ap + slot * stride_as + r[:, None] * stride_ar
        x_row = x_ptr + t * stride_xt
        k_start = split * (K_STEPS * BLOCK_K)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for step in tl.static_range(K_STEPS):  # the last split may end past the fan-in
            kk = k_start + step * BLOCK_K + k
            in_k = kk < fan_in
            xv = tl.load(x_row + kk * stride_xk, mask=in_k, other=0.0).to(tl.float32)
            av = tl.load(
                a_rows + kk[None, :] * stride_ak, mask=in_r[:, None] & in_k[None, :], other=0.0
            ).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(h_ptr + split * stride_hs + t * stride_ht + part * stride_hp + r, acc, mask=in_r)


@triton.jit
def _expand_part(
    h_row, stride_hs, splits, b_ptr, stride_bs, stride_br, slot, rank,
    out_row, stride_on, lo, width, col0,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, BLOCK_R)
    in_r = r < rank
    s = tl.arange(0, BLOCK_S)
    partial = tl.load(
        h_row + s[:, None] * stride_hs + r[None, :],
        mask=(s[:, None] < splits) & in_r[None, :],
        other=0.0,
    )
    h = tl.sum(partial.to(tl.float32), axis=0)
    n = col0 + tl.arange(0, BLOCK_N)
    in_n = n < width
    bv = tl.load(
        b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=in_r[:, None] & in_n[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(h[:, None] * bv, axis=0)
    o = out_row + (lo + n) * stride_on
    base = tl.load(o, mask=in_n, other=0.0).to(tl.float32)
    tl.store(o, (base + delta).to(out_row.dtype.element_ty), mask=in_n)


@triton.jit
def _expand_kernel(
    h_ptr, out_ptr, slots_ptr, b0_ptr, b1_ptr, b2_ptr, lo0, lo1, lo2, n0, n1, n2,
    blocks0, blocks1,
    stride_b0s, stride_b0r, stride_b1s, stride_b1r, stride_b2s, stride_b2r,
    rank, splits, stride_hs, stride_ht, stride_hp, stride_hq, stride_ot, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        h_row = h_ptr + t * stride_ht + slot * stride_hq
        out_row = out_ptr + t * stride_ot
        if j < blocks0:
            _expand_part(
                h_row, stride_hs, splits, b0_ptr, stride_b0s, stride_b0r, slot, rank,
                out_row, stride_on, lo0, n0, j * BLOCK_N, BLOCK_R, BLOCK_N, BLOCK_S,
            )  # fmt: skip
        elif j < blocks0 + blocks1:
            _expand_part(
                h_row + stride_hp, stride_hs, splits, b1_ptr, stride_b1s, stride_b1r, slot,
                rank, out_row, stride_on, lo1, n1, (j - blocks0) * BLOCK_N, BLOCK_R, BLOCK_N,
                BLOCK_S,
            )  # fmt: skip
        else:
            _expand_part(
                h_row + 2 * stride_hp, stride_hs, splits, b2_ptr, stride_b2s, stride_b2r, slot,
                rank, out_row, stride_on, lo2, n2, (j - blocks0 - blocks1) * BLOCK_N,
                BLOCK_R, BLOCK_N, BLOCK_S,
            )  # fmt: skip
