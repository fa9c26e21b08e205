"""The Triton device code of the INT8 and INT4 GEMMs (host sides: engine/quantization/
int8_gemm.py, int4_gemm.py, which say what each kernel computes and why). Imported only where
a kernel runs: it imports triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_tile(x, scale):
    """int8 of float32 x [BM, BK] by scale [BM, 1]: int8_kernels' arithmetic exactly."""
    v = tl.div_rn(x, scale)
    r = tl.floor(v + 0.5)  # half-to-even: a tie rounded up to an odd value goes down
    r = tl.where((r - v == 0.5) & (r % 2 != 0), r - 1.0, r)
    return tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)


@triton.jit
def rne_bf16(y):
    """float32 y rounded to bf16, nearest even, on the bits: the GPU's conversion for finite
    values (the interpreter's own conversion truncates, so its tests would not be exact)."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_out(out_ptr, offs, mask, y, BF16_OUT: tl.constexpr):
    if BF16_OUT:
        tl.store(out_ptr + offs, rne_bf16(y), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def int8_gemm_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, acc_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, divisor, min_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, QUANTIZE: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, BF16_OUT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk their columns together (weight columns reused from L2)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn

    if QUANTIZE:  # the token scales first: every program reads its rows' amax
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = row_ok[:, None] & ((k0 + rk)[None, :] < K)
            xt = tl.load(x_rows + (k0 + rk)[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=1))
        x_scale = tl.maximum(tl.div_rn(amax, divisor), min_scale)
    else:
        x_scale = tl.load(xs_ptr + rm, mask=row_ok, other=0.0)

    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_lo, k_lo + k_span, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            xm = row_ok[:, None]
            wm = col_ok[None, :]
        else:
            xm = row_ok[:, None] & (kk[None, :] < K)
            wm = col_ok[None, :] & (kk[:, None] < K)
        if QUANTIZE:
            xt = tl.load(x_rows + kk[None, :], mask=xm, other=0.0).to(tl.float32)
            a = quantize_tile(xt, x_scale[:, None])
        else:
            a = tl.load(x_rows + kk[None, :], mask=xm, other=0)
        if SWAP_AB:  # W [BN, BK] is the MMA's A operand, x^T its B: decode's rows are few
            b = tl.load(w_rows + kk[None, :], mask=tl.trans(wm), other=0)
            acc = tl.dot(b, tl.trans(a), acc, out_dtype=tl.int32)
        else:
            b = tl.load(w_cols + kk[:, None], mask=wm, other=0)  # [BK, BN], K-major
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)

    if SWAP_AB:
        acc = tl.trans(acc)
    offs = rm[:, None] * N + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    ws = tl.load(ws_ptr + rn, mask=col_ok, other=0.0)
    if SPLIT_K == 1:
        y = acc.to(tl.float32) * x_scale[:, None] * ws[None, :]
        store_out(out_ptr, offs, mask, y, BF16_OUT)
    else:
        tl.atomic_add(acc_ptr + offs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the counter moves
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice of this tile: the sum is complete
            total = tl.atomic_xchg(acc_ptr + offs, tl.zeros_like(acc), mask=mask)
            y = total.to(tl.float32) * x_scale[:, None] * ws[None, :]
            store_out(out_ptr, offs, mask, y, BF16_OUT)
            tl.atomic_xchg(cnt_ptr + pid, 0)


@triton.jit
def nibble_weight(words, i: tl.constexpr, scale, INTERPRET: tl.constexpr):
    """bf16 (q * scale in float32, nearest even) of nibble i of int32 words [BN, 16] (q + 8
    stored) by float32 scale [BN, 1]: the CPU path's weight. The nibble becomes a float by its
    bits (2^23 + u, then less 2^23 + 8: exact, two full-rate ops instead of a conversion)."""
    u = ((words >> (4 * i)) & 0xF) | 0x4B000000
    w = (u.to(tl.float32, bitcast=True) - 8388616.0) * scale
    if INTERPRET:  # the interpreter's own conversion truncates
        return rne_bf16(w)
    return w.to(tl.bfloat16)


@triton.jit(do_not_specialize=["M"])
def int4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, groups,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPANS: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, 16)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * (K // 8)
    s_rows = s_ptr + rn.to(tl.int64) * groups
    n_spans = K // 128
    per_split = tl.cdiv(n_spans, SPLIT_K * SPANS) * SPANS
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, n_spans)
    if SWAP_AB:  # W is the MMA's A operand (its rows fill the instruction's M), x^T its B
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(lo, hi, SPANS):
        for t in tl.static_range(SPANS):
            span = first + t
            live = span < hi
            # [BLOCK_N, 16] words: 64 contiguous bytes a row; nibble i = columns 16 i .. 16 i + 15
            words = tl.load(w_rows + span * 16 + rj[None, :], mask=col_ok[:, None] & live, other=0)
            if GROUP % 128 == 0:  # one group a span
                sc = tl.load(s_rows + (span * 128) // GROUP, mask=col_ok & live, other=0.0)
            for i in tl.static_range(8):
                k0 = span * 128 + 16 * i
                if GROUP % 128 != 0:
                    sc = tl.load(s_rows + k0 // GROUP, mask=col_ok & live, other=0.0)
                w = nibble_weight(words, i, sc[:, None], INTERPRET)
                xt = tl.load(x_rows + k0 + rj[None, :], mask=row_ok[:, None] & live, other=0.0)
                if INTERPRET:  # the interpreter's bf16 dot multiplies the raw bits: widen
                    w = w.to(tl.float32)
                    xt = xt.to(tl.float32)
                if SWAP_AB:
                    acc = tl.dot(w, tl.trans(xt), acc)
                else:
                    acc = tl.dot(xt, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    offs = rm[:, None] * N + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, rne_bf16(acc), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice: sum the partials in slice order
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                p = tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
                total += p
            tl.store(out_ptr + offs, rne_bf16(total), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def int4_dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, groups, group_size,
    BLOCK_N: tl.constexpr, BF16_OUT: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = tl.program_id(1)
    rj = tl.arange(0, 16)
    col_ok = rn < N
    words = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 8) + span * 16 + rj[None, :],
                    mask=col_ok[:, None], other=0)  # fmt: skip
    out_rows = out_ptr + rn[:, None].to(tl.int64) * K
    for i in tl.static_range(8):
        k0 = span * 128 + 16 * i
        sc = tl.load(s_ptr + rn.to(tl.int64) * groups + k0 // group_size, mask=col_ok, other=0.0)
        w = (((words >> (4 * i)) & 0xF) - 8).to(tl.float32) * sc[:, None]
        store_out(out_rows, k0 + rj[None, :], col_ok[:, None], w, BF16_OUT)
