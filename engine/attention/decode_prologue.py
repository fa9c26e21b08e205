"""What a CUDA-graph decode step does before an attention kernel that neither stores the new
k/v nor rotates (XQA, xqa_decode.py), in one Triton launch a layer.

Why: the Triton decode folds the store, RoPE and q's copy out of the qkv projection into its
own launch (triton_decode.py: `NewKV`, `Rope`); XQA cannot, so without this a graph step runs
three small kernels a layer before it (flashinfer's RoPE, the e4m3 store, `q.contiguous()`),
each with its launch gap.

`_prologue_kernel`, grid (KV heads, sequences): program (h, b) loads the GROUP query heads
that share KV head h of row b from q's strided view of the qkv output, rotates them at
positions[b] and writes them contiguous in q's dtype (the attention kernel's input); then it
takes the k/v of head h of row rows[b], rotates k at positions[rows[b]], divides both by the
layer's K/V scales and stores them, in the pool's dtype (saturated for e4m3), at slot
(blocks[b], offsets[b]). The rotation is the same float32 rotate-half as the Triton decode's,
so the pool holds the same bits whichever kernel stored the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_decode import NewKV, Rope, _rope_apply, _rope_loads
from engine.quantization.fp8_linear import FP8_DTYPE


@triton.jit
def _prologue_kernel(
    q_ptr, q_out_ptr, kv_ptr, k_ptr, v_ptr, rows_ptr, blocks_ptr, offsets_ptr, cos_sin_ptr,
    pos_ptr, sq_b, sq_h, so_b, so_h, sk_t, sk_h, sv_t, sv_h, s_blk, s_kv, s_tok, s_head,
    inv_k, inv_v,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
    POOL_FP8: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    b = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    heads = h * GROUP + rows
    # padded rows read the group's first head; they are never stored
    q_at = b * sq_b + tl.where(row_ok, heads, h * GROUP)[:, None] * sq_h + dims[None, :]
    src = tl.load(rows_ptr + b).to(tl.int64)
    dst_block = tl.load(blocks_ptr + b).to(tl.int64)
    dst_offset = tl.load(offsets_ptr + b)
    k_at = src * sk_t + h * sk_h + dims
    v = tl.load(v_ptr + src * sv_t + h * sv_h + dims).to(tl.float32)
    if ROPE:
        q, q_partner, q_cos, q_sin = _rope_loads(
            q_ptr, q_at, dims[None, :], cos_sin_ptr, tl.load(pos_ptr + b), HEAD_DIM
        )
        k, k_partner, k_cos, k_sin = _rope_loads(
            k_ptr, k_at, dims, cos_sin_ptr, tl.load(pos_ptr + src), HEAD_DIM
        )
        q = _rope_apply(q, q_partner, q_cos, q_sin, dims[None, :], HEAD_DIM)
        k = _rope_apply(k, k_partner, k_cos, k_sin, dims, HEAD_DIM)
    else:
        q = tl.load(q_ptr + q_at).to(tl.float32)
        k = tl.load(k_ptr + k_at).to(tl.float32)
    o = q_out_ptr + b * so_b + heads[:, None] * so_h + dims[None, :]
    tl.store(o, q.to(q_out_ptr.dtype.element_ty), mask=row_ok[:, None])
    k = k * inv_k
    v = v * inv_v
    if POOL_FP8:
        k = tl.minimum(tl.maximum(k, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    dst = kv_ptr + dst_block * s_blk + dst_offset * s_tok + h * s_head + dims
    tl.store(dst, k.to(kv_ptr.dtype.element_ty))
    tl.store(dst + s_kv, v.to(kv_ptr.dtype.element_ty))


def decode_prologue(
    q: torch.Tensor,
    new_kv: NewKV,
    pool: torch.Tensor,
    k_scale: float,
    v_scale: float,
    rope: Rope | None = None,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store `new_kv` into `pool` (`[blocks, 2, page, kv_heads, dim]`, any strides but a
    contiguous head_dim) and return q ([tokens, heads, dim], any strides but a contiguous
    head_dim) contiguous in `q_out`; with `rope`, q and the stored k rotated first."""
    tokens, heads, dim = q.shape
    kv_heads = pool.shape[3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if dim & (dim - 1) or pool.shape[4] != dim:
        raise ValueError(f"head_dim {dim} is not a power of two or not the pool's")
    tensors = (q, pool, new_kv.k, new_kv.v)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the head dimension of q, k, v and the pool must be contiguous")
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q_out.shape != q.shape or not q_out.is_contiguous():
        raise ValueError(f"q_out must be a contiguous {tuple(q.shape)} tensor")
    group = heads // kv_heads
    k, v = new_kv.k, new_kv.v
    cos_sin, positions = (rope.cos_sin, rope.positions) if rope else (q, new_kv.rows)
    _prologue_kernel[(kv_heads, tokens)](
        q, q_out, pool, k, v, new_kv.rows, new_kv.blocks, new_kv.offsets, cos_sin, positions,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        1.0 / k_scale, 1.0 / v_scale,
        GROUP=group, ROWS=triton.next_power_of_2(group), HEAD_DIM=dim, ROPE=rope is not None,
        POOL_FP8=pool.dtype == FP8_DTYPE, num_warps=1,
    )  # fmt: skip
    return q_out
