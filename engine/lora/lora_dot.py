"""The "dot" LoRA graph kernel: dense over the slots, two launches per projection.

For one fused projection (q/k/v of qkv, gate/up of gate_up) and every token t with slot s,

    out[t, part] += (x[t] @ A[s, part]^T) @ B[s, part]

is computed as

1. shrink (`shrink_dot`): h = x @ A_all^T against every slot's A at once (one cuBLAS
   matmul, [tokens, parts * slots * rank]). It reads only x and A, so the model starts it on
   a side stream before the base projection (`LoraStep.begin`): 1.065x the base step at 4
   slots on the H200 against 1.155x with it in line. A Triton split-K shrink whose last
   split reduced the partials (deterministic, no reduce launch) measured slower on the H200
   (bench_lora B=64, 4 slots: 1.200x the base step against 1.155x with cuBLAS), so cuBLAS
   it is.
2. expand (`expand_dot`, `_expand_kernel`): per column block of every part, over a tile of
   tokens, one tensor-core dot of h (each token's other slots' columns masked to zero in
   registers) with every slot's B for those columns, added into out in place. B is read
   once per tile of tokens, not once per token as in a per-token (BGMV) expand, and the
   mask costs no launch (the dense torch kernel multiplies h by a one-hot mask, then adds
   part by part).

Like the dense torch kernel it reads every slot's weights each step (max_loras x rank), so
its cost does not depend on how many adapters the batch uses, and it needs every slot's
weights finite: a masked slot contributes 0 x B. Shapes depend only on the number of tokens
and the model, never on the slots: CUDA graphs hold for any slot values. Measured on the
H200 in `python -m benchmarks lora` (kernel "triton-dot").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_PARTS = 3
BLOCK_K = 64
"""h columns per expand step."""
EXPAND_BLOCK_N = 128
MAX_BLOCK_T = 64


def add_lora_dot(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    columns: Sequence[tuple[int, int]],
) -> None:
    """out[t, lo_p:hi_p] += (x[t] @ a[p, slots[t]]^T) @ b[p][slots[t]] for every part p and
    every token t with slots[t] >= 0 (in place; other rows untouched). Two launches (cuBLAS
    may split the shrink's long fan-in and add a reduction): `shrink_dot`, then `expand_dot`.

    x: [tokens, in]; out: [tokens, >= hi of the last part]; slots: [tokens] int32/int64,
    contiguous; a: [parts, rows, rank, in]; b[p]: [rows, rank, hi_p - lo_p] with evenly
    strided (slot, rank) rows and contiguous columns; columns[p]: (lo_p, hi_p).
    """
    if x.shape[0] == 0:
        return
    expand_dot(shrink_dot(x, a), out, slots, a.shape, b, columns)


def shrink_dot(x: torch.Tensor, a: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """h = x @ every slot's A of every part ([tokens, parts * rows * rank]; into `h` when
    given). It reads only x and A, so it may run on another stream beside the base projection
    (`LoraStep.begin`)."""
    num_parts, rows, rank, fan_in = a.shape
    weight = a.reshape(num_parts * rows * rank, fan_in)
    if h is None:
        return torch.nn.functional.linear(x, weight)
    return torch.mm(x, weight.t(), out=h)


def expand_dot(
    h: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    a_shape: Sequence[int],
    b: Sequence[torch.Tensor],
    columns: Sequence[tuple[int, int]],
) -> None:
    """out[t, part p] += h[t, p, slots[t]] @ b[p][slots[t]] (in place), h from `shrink_dot`
    over A of shape `a_shape` ([parts, rows, rank, in])."""
    num_parts, rows, rank, _ = a_shape
    t = h.shape[0]
    if t == 0:
        return
    if not 1 <= num_parts <= MAX_PARTS or len(b) != num_parts or len(columns) != num_parts:
        raise ValueError(f"1 to {MAX_PARTS} parts with one B and one column range each")
    if any(bp.stride(2) != 1 or bp.stride(0) != rank * bp.stride(1) for bp in b):
        raise ValueError("each B's (slot, rank) rows must be evenly strided, columns contiguous")
    width = rows * rank  # h columns of one part
    block_t = max(16, min(MAX_BLOCK_T, triton.next_power_of_2(t)))
    t_blocks = triton.cdiv(t, block_t)
    widths = [hi - lo for lo, hi in columns]
    blocks = [triton.cdiv(w, EXPAND_BLOCK_N) for w in widths]
    pad = MAX_PARTS - num_parts
    bs = [*b, *[b[0]] * pad]
    los = [lo for lo, _ in columns] + [0] * pad
    widths += [0] * pad
    _expand_kernel[(sum(blocks), t_blocks)](
        h, out, slots, *bs, *los, *widths, blocks[0], blocks[1] if num_parts > 1 else 0,
        bs[0].stride(1), bs[1].stride(1), bs[2].stride(1), t, h.stride(0), width,
        out.stride(0), out.stride(1),
        RANK=rank, ROWS=width, BLOCK_T=block_t, BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(width)),
    )  # fmt: skip


@triton.jit
def _expand_kernel(
    h_ptr, out_ptr, slots_ptr, b0_ptr, b1_ptr, b2_ptr, lo0, lo1, lo2, n0, n1, n2,
    blocks0, blocks1, stride_b0, stride_b1, stride_b2, num_tokens, stride_ht, stride_hp,
    stride_ot, stride_on,
    RANK: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    slot = tl.load(slots_ptr + tokens, mask=t_ok, other=-1)
    if j < blocks0:
        b_ptr, stride_b, lo, width, col0, part = b0_ptr, stride_b0, lo0, n0, j, 0
    elif j < blocks0 + blocks1:
        b_ptr, stride_b, lo, width, col0, part = b1_ptr, stride_b1, lo1, n1, j - blocks0, 1
    else:
        b_ptr, stride_b, lo = b2_ptr, stride_b2, lo2
        width, col0, part = n2, j - blocks0 - blocks1, 2
    n = col0 * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    h_rows = h_ptr + tokens[:, None] * stride_ht + part * stride_hp
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, ROWS, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < ROWS
        mine = (k[None, :] // RANK == slot[:, None]) & t_ok[:, None] & k_ok[None, :]  # own slot
        b_ok = k_ok[:, None] & n_ok[None, :]
        bv = tl.load(b_ptr + k[:, None] * stride_b + n[None, :], mask=b_ok, other=0.0)
        hv = tl.load(h_rows + k[None, :], mask=mine, other=0.0).to(bv.dtype)
        acc += tl.dot(hv, bv)
    o = out_ptr + tokens[:, None] * stride_ot + (lo + n)[None, :] * stride_on
    m = t_ok[:, None] & n_ok[None, :]
    base = tl.load(o, mask=m, other=0.0).to(tl.float32)
    tl.store(o, (base + acc).to(out_ptr.dtype.element_ty), mask=m)
