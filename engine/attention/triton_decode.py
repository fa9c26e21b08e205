"""Paged decode attention in Triton that reads e4m3 (or float) KV pages as they are stored.

Why: flashinfer 0.7.4's decode over an e4m3 pool runs at ~1.9x its KV-read floor on the H200
(118 µs a layer at B=64 x 2048, Llama-3-70B heads) where its bf16 decode runs at 1.05x, so an
e4m3 pool saved only 11% of attention time (docs/benchmarks.md, "FP8, 2026-12-03"). This
kernel converts each e4m3 tile in registers right before the tensor-core dot and keeps the
per-layer K/V scales out of the inner loop (one multiply of the scores, one of the output).

Two launches, flash-decoding style (split-KV):

- `_split_kernel`, grid (KV heads, sequences, splits): program (h, b, s) loads the GROUP
  query heads that share KV head h (padded to 16 rows for the dot), walks its split's share
  of sequence b's tokens BLOCK_N at a time through the page list, gathering each token's K
  and V row of head h from its page, and keeps an online softmax (base 2). It writes its
  partial output (normalized by its own sum), its running max and its log-sum; with one
  split it writes the final output instead and there is no second launch.
- `_merge_kernel`, grid (sequences, query heads): combines the splits' partials.

What would otherwise be separate kernels around it, the CUDA-graph decode folds into the
same launch (each one launch fewer a layer, ~2-3 µs with its gap on the H200):
- `NewKV`: the program whose split holds the sequence's last token (this step's) walks its
  split without that token, then takes the step's k/v row of head h from registers: it
  quantizes it as the pool holds it (e4m3 for an e4m3 pool), stores it there and attends to
  it. No store kernel runs, and the loop never waits on the store.
- `Rope`: q and that k arrive unrotated and are rotated in float32 on load; no RoPE kernel.
- `out_scale`: the output is written as o_proj's e4m3 input; no cast kernel.

Inputs are those flashinfer's plan takes, already on the device: `kv_indptr` (sequence b's
pages are page_indices[kv_indptr[b]:kv_indptr[b+1]]) and `last_page_len`. Nothing is planned
on the host and nothing syncs: grid and buffers depend only on the batch size and the split
count, so a CUDA graph captured once replays for any lengths and page lists.

The pool is the strided per-layer view `[blocks, 2, page, kv_heads, head_dim]` of any pool
layout: every stride is read from the tensor (only head_dim must be contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.quantization.fp8_linear import FP8_DTYPE

LOG2E = 1.4426950408889634
MIN_ROWS = 16
"""Rows of the query tile: tensor-core dots need 16; a GQA group of 4 or 8 is padded."""
MIN_ROWS_TOKENS_MAJOR = 8
"""The same as the N of `_attend_tokens_major`'s dots, which need 8."""


@dataclass(frozen=True)
class NewKV:
    """This step's k/v of each sequence, which the kernel stores into the pool before it
    attends (one launch instead of a store kernel and attention): row rows[b] of k and v
    ([tokens, kv_heads, dim], contiguous heads; views of the qkv projection are fine) goes
    to slot (blocks[b], offsets[b]), divided by the layer's K/V scales (in e4m3 for an e4m3
    pool). Sequence b's slot must be its last token's (a CUDA-graph padding row may write
    row 0's values to row 0's slot again)."""

    k: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor


@dataclass(frozen=True)
class Rope:
    """q and the new k arrive unrotated: the kernel applies rotate-half RoPE itself, q of
    sequence b at positions[b], the k it stores at positions[rows[b]] (NewKV), from the
    model's float32 cos/sin cache ([max_positions, dim]: cos in the first half, sin in the
    second; engine/modeling/llama.py `Rotary.cos_sin_cache`)."""

    cos_sin: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the split kernel. The defaults are the fastest of a sweep on the H200
    (`python -m benchmarks attention`, e4m3, B=64 x 2048, 64/8 heads: 98.2 µs; the same tiles
    without kv_first and prefetch 123 µs, BLOCK_N 64 or 256 or 8 warps 138-190 µs)."""

    block_n: int = 128
    """Tokens per inner step (a multiple of the page size or a divisor of it)."""
    num_warps: int = 4
    num_stages: int = 3
    kv_first: bool = True
    """Issue the V load with the K load, before the scores (more bytes in flight)."""
    prefetch: bool = True
    """Load the next tile's page ids in this step, so a tile's K/V addresses are known
    before its step starts (no load waits on another load)."""
    heads_first: bool = True
    """Grid (KV heads, sequences, splits): the KV heads of one sequence run side by side,
    so their reads of a page (one 16-token run of every head) are adjacent in time (H200:
    97.2 µs vs 98.1 with sequences first)."""
    scores_fp8: bool = False
    """An e4m3 pool only: q quantized to e4m3 (a scale per head), the scores computed as
    K q^T over e4m3 operands (`_attend_tokens_major`: no conversion of K, GROUP rows padded
    to 8); kv_first and prefetch are implied."""


@triton.jit
def _out_mul(v_scale, out_scale_ptr, OUT_FP8: tl.constexpr):
    """What the output is multiplied by before it is stored: v_scale, and for an e4m3 output
    (the next GEMM's input, so no separate cast kernel runs) 1 / out_scale too. Called at a
    program's start, so the scale's load is not a memory round trip at its end."""
    if OUT_FP8:
        return v_scale / tl.load(out_scale_ptr)
    return v_scale + 0.0


@triton.jit
def _output(o, out_ptr, OUT_FP8: tl.constexpr):
    """o as stored: in the output's dtype; an e4m3 one saturated at +-448."""
    if OUT_FP8:
        o = tl.minimum(tl.maximum(o, -448.0), 448.0)
    return o.to(out_ptr.dtype.element_ty)


@triton.jit
def _rope_loads(x_ptr, offsets, dims, cos_sin_ptr, pos, HEAD_DIM: tl.constexpr):
    """What rotate-half RoPE of the rows at x_ptr + offsets (one row of dims per offset) at
    position `pos` needs, loaded (so the loads can be issued long before `_rope_apply` uses
    them): the rows, their rotate-half partners, cos and sin (the cache holds cos in its first
    half, sin in its second)."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(x_ptr + offsets)
    partner = tl.load(x_ptr + offsets + (dims + half) % HEAD_DIM - dims)
    table = cos_sin_ptr + pos.to(tl.int64) * HEAD_DIM + dims % half
    return x, partner, tl.load(table), tl.load(table + half)


@triton.jit
def _rope_apply(x, partner, cos, sin, dims, HEAD_DIM: tl.constexpr):
    """The rotation of `_rope_loads`' rows, in float32."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(dims < half, -partner.to(tl.float32), partner.to(tl.float32))
    return x.to(tl.float32) * cos + partner * sin


@triton.jit
def _attend(
    q, scale_log2, kv_ptr, page_ids, next_page, lo, end, s_blk, s_kv, s_tok, head_at, dims,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FIRST: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Online softmax of q's rows ([ROWS, HEAD_DIM] fp16) over tokens [lo, end) of the page
    list, BLOCK_N at a time, each tile converted to fp16 for the dots: (running max, sum,
    unnormalized output [ROWS, HEAD_DIM]). `next_page`: the first tile's page ids."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        tok = start + cols
        tok_ok = tok < end
        if PREFETCH:
            page = next_page
        else:
            page = tl.load(page_ids + tok // PAGE, mask=tok_ok, other=0)
        row = page.to(tl.int64) * s_blk + (tok % PAGE) * s_tok + head_at
        ptrs = kv_ptr + row[:, None] + dims[None, :]
        k = tl.load(ptrs, mask=tok_ok[:, None], other=0.0)
        if KV_FIRST:
            v = tl.load(ptrs + s_kv, mask=tok_ok[:, None], other=0.0)
        if PREFETCH:
            after = tok + BLOCK_N
            next_page = tl.load(page_ids + after // PAGE, mask=after < end, other=0)
        qk = tl.dot(q, tl.trans(k.to(tl.float16))) * scale_log2
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not KV_FIRST:
            v = tl.load(ptrs + s_kv, mask=tok_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_tokens_major(
    q8, score_mul, kv_ptr, page_ids, next_page, lo, end, s_blk, s_kv, s_tok, head_at, dims,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`_attend` for an e4m3 pool with e4m3 scores: S^T = K q8^T, tokens as the MMA's M (a
    Hopper warpgroup MMA over e4m3 operands takes K from shared memory as the pool holds it:
    no conversion, and q's GROUP rows are its N, padded to 8 rather than 16), scaled per row
    by `score_mul`; then O^T = V^T P^T in fp16. V is loaded with K, page ids a tile ahead."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([HEAD_DIM, ROWS], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        tok = start + cols
        tok_ok = tok < end
        row = next_page.to(tl.int64) * s_blk + (tok % PAGE) * s_tok + head_at
        ptrs = kv_ptr + row[:, None] + dims[None, :]
        k = tl.load(ptrs, mask=tok_ok[:, None], other=0.0)
        v = tl.load(ptrs + s_kv, mask=tok_ok[:, None], other=0.0)
        after = tok + BLOCK_N
        next_page = tl.load(page_ids + after // PAGE, mask=after < end, other=0)
        st = tl.dot(k, tl.trans(q8)) * score_mul[None, :]  # [BLOCK_N, ROWS]
        st = tl.where(tok_ok[:, None], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        alpha = tl.exp2(m_i - m_new)
        pt = tl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pt, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), pt.to(tl.float16))
        m_i = m_new
    return m_i, l_i, tl.trans(acc)


@triton.jit
def _split_kernel(
    q_ptr, kv_ptr, page_ptr, indptr_ptr, last_ptr, out_ptr, part_ptr, stat_ptr, out_scale_ptr,
    k_ptr, v_ptr, rows_ptr, blocks_ptr, offsets_ptr, cos_sin_ptr, pos_ptr,
    sq_b, sq_h, s_blk, s_kv, s_tok, s_head, so_b, so_h, sk_t, sk_h, sv_t, sv_h,
    num_splits, scale_log2, v_scale, inv_k, inv_v,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, KV_FIRST: tl.constexpr, OUT_FP8: tl.constexpr,
    PREFETCH: tl.constexpr, HEADS_FIRST: tl.constexpr,
    STORE: tl.constexpr, POOL_FP8: tl.constexpr, ROPE: tl.constexpr, SCORES_FP8: tl.constexpr,
):  # fmt: skip
    if HEADS_FIRST:
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    s = tl.program_id(2)
    # every load that does not wait on another is issued first: the loop's first K/V tile is
    # three memory round trips away (lengths, page ids, the tile) with or without NewKV/Rope
    first_page = tl.load(indptr_ptr + b)
    num_pages = tl.load(indptr_ptr + b + 1) - first_page
    last_len = tl.load(last_ptr + b)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    heads = h * GROUP + rows
    row_ok = rows < GROUP
    # padded rows read the group's first head; their scores are never stored
    q_at = b * sq_b + tl.where(row_ok, heads, h * GROUP)[:, None] * sq_h + dims[None, :]
    if ROPE:
        q_pos = tl.load(pos_ptr + b)
    if STORE:
        src = tl.load(rows_ptr + b).to(tl.int64)
        dst_block = tl.load(blocks_ptr + b).to(tl.int64)
        dst_offset = tl.load(offsets_ptr + b)
    seq_len = tl.maximum(num_pages - 1, 0) * PAGE + tl.where(num_pages > 0, last_len, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = s * per_split
    hi = tl.minimum(seq_len, lo + per_split)
    cols = tl.arange(0, BLOCK_N)
    page_ids = page_ptr + first_page
    end = hi
    if STORE:
        # NewKV: this step's token (the sequence's last) is not read back from the pool: the
        # program whose split holds it attends to it from registers after the loop, and
        # stores it then, so nothing waits on the store and no barrier is needed
        holds_last = (lo <= seq_len - 1) & (seq_len - 1 < hi)
        end = tl.where(holds_last, hi - 1, hi)
        k_at = src * sk_t + h * sk_h + dims
        if ROPE:
            k_new, k_partner, k_cos, k_sin = _rope_loads(
                k_ptr, k_at, dims, cos_sin_ptr, tl.load(pos_ptr + src), HEAD_DIM
            )
        else:
            k_new = tl.load(k_ptr + k_at)
        v_new = tl.load(v_ptr + src * sv_t + h * sv_h + dims)
    next_page = tl.load(page_ids + (lo + cols) // PAGE, mask=lo + cols < end, other=0)
    if ROPE:
        q, q_partner, q_cos, q_sin = _rope_loads(
            q_ptr, q_at, dims[None, :], cos_sin_ptr, q_pos, HEAD_DIM
        )
        q = _rope_apply(q, q_partner, q_cos, q_sin, dims[None, :], HEAD_DIM)
    else:
        q = tl.load(q_ptr + q_at).to(tl.float32)
    q = q.to(tl.float16).to(tl.float32)  # as the fp16 dot takes it (and e4m3 scales it)
    out_mul = _out_mul(v_scale, out_scale_ptr, OUT_FP8)

    if SCORES_FP8:
        # q in e4m3, one scale a row (its largest magnitude to 448): the scores' dot reads K
        # as the pool holds it
        q_scale = tl.maximum(tl.max(tl.abs(q), 1) / 448.0, 1e-30)
        q8 = (q / q_scale[:, None]).to(tl.float8e4nv)
        q = q8.to(tl.float32) * q_scale[:, None]  # what the scores see (the new token's too)
        m_i, l_i, acc = _attend_tokens_major(
            q8, q_scale * scale_log2, kv_ptr, page_ids, next_page, lo, end, s_blk, s_kv, s_tok,
            h * s_head, dims, ROWS, HEAD_DIM, PAGE, BLOCK_N,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _attend(
            q.to(tl.float16), scale_log2, kv_ptr, page_ids, next_page, lo, end, s_blk, s_kv,
            s_tok, h * s_head, dims, ROWS, HEAD_DIM, PAGE, BLOCK_N, KV_FIRST, PREFETCH,
        )  # fmt: skip

    if STORE:  # noqa: SIM102 (holds_last exists only with STORE, a compile-time branch)
        if holds_last:
            if ROPE:  # k as stored is rotated at its own row's position
                k_f = _rope_apply(k_new, k_partner, k_cos, k_sin, dims, HEAD_DIM) * inv_k
            else:
                k_f = k_new.to(tl.float32) * inv_k
            v_f = v_new.to(tl.float32) * inv_v
            if POOL_FP8:
                k_f = tl.minimum(tl.maximum(k_f, -448.0), 448.0)
                v_f = tl.minimum(tl.maximum(v_f, -448.0), 448.0)
            k_st = k_f.to(kv_ptr.dtype.element_ty)
            v_st = v_f.to(kv_ptr.dtype.element_ty)
            dst = kv_ptr + dst_block * s_blk + dst_offset * s_tok + h * s_head + dims
            tl.store(dst, k_st)
            tl.store(dst + s_kv, v_st)
            # the token's score and value as the loop would take them from the pool (fp16
            # operands, float32 sums)
            k16 = k_st.to(tl.float16).to(tl.float32)
            v16 = v_st.to(tl.float16).to(tl.float32)
            qk_new = tl.sum(q * k16[None, :], 1) * scale_log2
            m_last = tl.maximum(m_i, qk_new)
            alpha_last = tl.exp2(m_i - m_last)
            p_last = tl.exp2(qk_new - m_last)
            l_i = l_i * alpha_last + p_last
            p16 = p_last.to(tl.float16).to(tl.float32)
            acc = acc * alpha_last[:, None] + p16[:, None] * v16[None, :]
            m_i = m_last

    has = l_i > 0
    safe_l = tl.where(has, l_i, 1.0)
    part = acc / safe_l[:, None]
    if SINGLE:
        o = out_ptr + b * so_b + heads[:, None] * so_h + dims[None, :]
        tl.store(o, _output(part * out_mul, out_ptr, OUT_FP8), mask=row_ok[:, None])
    else:
        num_kv = tl.num_programs(0) if HEADS_FIRST else tl.num_programs(1)
        qh = b * (num_kv * GROUP) + heads  # flat (sequence, query head)
        slot = qh * num_splits + s
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + dims[None, :], part, mask=row_ok[:, None])
        # log-sum in base 2 (-inf for an empty split)
        lse = tl.where(has, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(stat_ptr + slot, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    part_ptr, stat_ptr, out_ptr, out_scale_ptr, num_heads, so_b, so_h, v_scale,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, OUT_FP8: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    qh = b * num_heads + h
    out_mul = _out_mul(v_scale, out_scale_ptr, OUT_FP8)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(stat_ptr + qh * SPLITS + splits)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    part = tl.load(part_ptr + (qh * SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :])
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o = _output(o * out_mul, out_ptr, OUT_FP8)
    tl.store(out_ptr + b * so_b + h * so_h + dims, o)


MAX_SPLITS = 16
"""Past 16 splits a program's share is too short to pay for its start and the merge: on the
H200 at B=1 x 2048 tokens (32/8 heads, BLOCK_N 128) 16 splits took 8.7 µs (e4m3, 3 stages)
and 9.1 µs (bf16, 2 stages) against 12.7 and 11.3 µs with 64 (docs/benchmarks.md, "FP8,
2026-12-05 (sixth session)")."""


def default_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so that a launch has ~4 programs per SM: a power of two,
    at most MAX_SPLITS, 1 once the batch alone fills the GPU."""
    want = max(1, (4 * num_sms) // max(1, batch * num_kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def default_tiles(kv_dtype: torch.dtype, scores_fp8: bool = False) -> DecodeTiles:
    """The launch shape for a pool of `kv_dtype`: DecodeTiles' defaults for e4m3; BLOCK_N 32
    for a float pool, whose 128-token tiles in 3 stages take 139 KB of shared memory (one
    program an SM). On the H200 (32/8 heads, bf16, the graph step's fused store and RoPE)
    BLOCK_N 32 took 9.8 µs at B=1 and 40.8 µs at B=16 against 17.7 and 57.8 µs with 128
    (docs/benchmarks.md, "FP8, 2026-12-05 (sixth session)")."""
    if kv_dtype == FP8_DTYPE:
        return DecodeTiles(scores_fp8=scores_fp8)
    if scores_fp8:
        raise ValueError(f"e4m3 scores need an e4m3 pool, got {kv_dtype}")
    return DecodeTiles(block_n=32)


class PagedDecode:
    """One decode attention launch shape: a batch size and split count, with the buffers the
    split kernel writes (fixed, so CUDA graphs can capture `run`)."""

    def __init__(
        self,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        device: torch.device,
        num_splits: int,
        tiles: DecodeTiles | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"head_dim {head_dim} is not a power of two >= 16")
        if num_splits < 1 or num_splits & (num_splits - 1):
            raise ValueError(f"num_splits {num_splits} is not a power of two")
        self.batch, self.num_heads, self.num_kv_heads = batch, num_heads, num_kv_heads
        self.head_dim, self.page_size, self.num_splits = head_dim, page_size, num_splits
        self.group = num_heads // num_kv_heads
        self.tiles = tiles or DecodeTiles()
        least = MIN_ROWS_TOKENS_MAJOR if self.tiles.scores_fp8 else MIN_ROWS
        self.rows = max(least, triton.next_power_of_2(self.group))
        self.last_launch: object = None
        """The split kernel's last compiled launch (registers, shared memory: benchmarks)."""
        n = batch * num_heads * num_splits
        split = num_splits > 1
        self._part = torch.empty(n * head_dim if split else 1, dtype=torch.float32, device=device)
        self._stat = torch.empty(n if split else 1, dtype=torch.float32, device=device)

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        page_indices: torch.Tensor,
        kv_indptr: torch.Tensor,
        last_page_len: torch.Tensor,
        sm_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
        out_scale: torch.Tensor | None = None,
        new_kv: NewKV | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Attention of `q` [batch, heads, dim] over the pages of each sequence in `kv`
        ([blocks, 2, page, kv_heads, dim], any strides but a contiguous head_dim). The int32
        page arrays are on q's device. Returns `out` ([batch, heads, dim], q's dtype; with
        `out_scale`, a float32 device scalar, the output / out_scale saturated in e4m3).
        `new_kv`: store this step's k/v first, in the same launch (NewKV); `rope`: q and
        those k are not rotated yet (Rope; needs new_kv)."""
        batch, heads, dim = q.shape
        if (batch, heads, dim) != (self.batch, self.num_heads, self.head_dim):
            raise ValueError(
                f"q {tuple(q.shape)} is not ({self.batch}, {self.num_heads}, {self.head_dim})"
            )
        if kv.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("the head dimension of q and the KV pool must be contiguous")
        if out is None:
            out = torch.empty_like(q, dtype=q.dtype if out_scale is None else FP8_DTYPE)
        fp8_out = out_scale is not None
        if fp8_out != (out.dtype == FP8_DTYPE):
            raise ValueError("an e4m3 output goes with an out_scale, and only with one")
        single = self.num_splits == 1
        t = self.tiles
        grid = (batch, self.num_kv_heads, self.num_splits)
        if t.heads_first:
            grid = (self.num_kv_heads, batch, self.num_splits)
        if t.scores_fp8 and kv.dtype != FP8_DTYPE:
            raise ValueError("e4m3 scores (scores_fp8) need an e4m3 pool")
        if rope is not None and new_kv is None:
            raise ValueError("rotating in the kernel needs the new k/v to store (new_kv)")
        new = new_kv or NewKV(q, q, kv_indptr, kv_indptr, kv_indptr)  # unread placeholders
        cos_sin, positions = (rope.cos_sin, rope.positions) if rope else (self._stat, kv_indptr)
        if new_kv is not None and (new.k.stride(-1) != 1 or new.v.stride(-1) != 1):
            raise ValueError("the head dimension of the new k and v must be contiguous")
        launched = _split_kernel[grid](
            q, kv, page_indices, kv_indptr, last_page_len, out, self._part, self._stat,
            out_scale if fp8_out else self._stat,
            new.k, new.v, new.rows, new.blocks, new.offsets, cos_sin, positions,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            out.stride(0), out.stride(1),
            new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1),
            self.num_splits, sm_scale * k_scale * LOG2E, v_scale, 1.0 / k_scale, 1.0 / v_scale,
            GROUP=self.group, ROWS=self.rows, HEAD_DIM=dim, PAGE=self.page_size,
            BLOCK_N=t.block_n, SINGLE=single, KV_FIRST=t.kv_first, OUT_FP8=fp8_out,
            PREFETCH=t.prefetch, HEADS_FIRST=t.heads_first,
            STORE=new_kv is not None, POOL_FP8=kv.dtype == FP8_DTYPE, ROPE=rope is not None,
            SCORES_FP8=t.scores_fp8,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
        self.last_launch = launched
        if not single:
            _merge_kernel[(batch, heads)](
                self._part, self._stat, out, out_scale if fp8_out else self._stat, heads,
                out.stride(0), out.stride(1), v_scale,
                SPLITS=self.num_splits, HEAD_DIM=dim, OUT_FP8=fp8_out, num_warps=4,
            )  # fmt: skip
        return out


def reference_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    page_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The same attention in float32 torch, one sequence at a time (tests and self-checks)."""
    indptr, last = kv_indptr.tolist(), last_page_len.tolist()
    page = kv.shape[2]
    group = q.shape[1] // kv.shape[3]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        pages = page_indices[indptr[b] : indptr[b + 1]].long()
        n = (len(pages) - 1) * page + last[b]
        seq = kv[pages].float()  # [pages, 2, page, kv_heads, dim]
        k = seq[:, 0].reshape(-1, *seq.shape[-2:])[:n] * k_scale
        v = seq[:, 1].reshape(-1, *seq.shape[-2:])[:n] * v_scale
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def splits_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """`default_splits` for the device's SM count (132 on an H200; 4 off CUDA)."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    return default_splits(batch, num_kv_heads, sms)
