"""The Triton split-KV decode kernel (engine/attention/triton_decode.py) against a float32 torch
reference, in Triton's interpreter on CPU (GPU: tests/gpu/test_fp8_fused_gpu.py).

Whether a kernel is interpreted is fixed when Triton defines it (TRITON_INTERPRET at import),
so the launches run in a subprocess; the inputs and the reference are made here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import pytest
import torch
import triton_interpret
from fp8_reference import rounded_to_e4m3_per_head

from engine.attention.flashinfer_backend import select_decode_kernel
from engine.attention.triton_decode import (
    MAX_SPLITS,
    DecodeTiles,
    NewKV,
    Rope,
    default_splits,
    default_tiles,
    reference_decode,
)


@dataclass(frozen=True)
class Case:
    """One launch: a pool (any layout's per-layer view), page arrays and the kernel's shape."""

    q: torch.Tensor
    kv: torch.Tensor
    pages: torch.Tensor
    indptr: torch.Tensor
    last: torch.Tensor
    splits: int
    tiles: DecodeTiles
    k_scale: float = 1.0
    v_scale: float = 1.0
    out_scale: float | None = None
    """An e4m3 output (o_proj's input) divided by this scale; None: q's dtype."""
    new_kv: NewKV | None = None
    """The kernel stores these k/v first (then the output is (attention, the pool))."""
    rope: Rope | None = None


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from engine.attention.triton_decode import PagedDecode

    cases: list[Case] = torch.load(inputs, weights_only=False)
    outs = []
    for c in cases:
        b, heads, dim = c.q.shape
        kernel = PagedDecode(
            b, heads, c.kv.shape[3], dim, c.kv.shape[2], c.q.device, c.splits, c.tiles
        )
        scale = dim**-0.5
        out_scale = None if c.out_scale is None else torch.tensor(c.out_scale)
        args = (c.q, c.kv, c.pages, c.indptr, c.last, scale, c.k_scale, c.v_scale)
        out = kernel.run(*args, out_scale=out_scale, new_kv=c.new_kv, rope=c.rope)
        outs.append(out if c.new_kv is None else (out, c.kv))
    torch.save(outs, outputs)


def interpret(cases: list[Case], tmp_path: Path) -> list[torch.Tensor]:
    return cast(list[torch.Tensor], triton_interpret.interpret(__file__, cases, tmp_path))


def make_case(
    lens: list[int],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    splits: int,
    tiles: DecodeTiles,
    head_major: bool = False,
    page: int = 4,
    dim: int = 32,
    seed: int = 0,
) -> Case:
    """Sequences of `lens` tokens over pages in random order of a 3-layer pool (layer 1)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = [-(-n // page) for n in lens]
    blocks = sum(num_pages) + 3
    pool = torch.randn(blocks, 3, 2, page, kv_heads, dim, generator=gen).clamp(-3, 3).to(dtype)
    if head_major:  # [blocks, kv_heads, layers, 2, page, dim], the same per-layer view
        kv = pool.permute(0, 4, 1, 2, 3, 5).contiguous()[:, :, 1].permute(0, 2, 3, 1, 4)
    else:
        kv = pool[:, 1]
    order = torch.randperm(blocks, generator=gen)[: sum(num_pages)].int()
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, num_pages, strict=True)])
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scales = (0.5, 0.25) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    return Case(q, kv, order, indptr, last.int(), splits, tiles, *scales)


def check(cases: list[Case], tmp_path: Path) -> None:
    """Each case's output against the float32 reference; an e4m3 output (out_scale) against
    the same launch's float output divided by out_scale and rounded to e4m3."""
    floats = [replace(c, out_scale=None) for c in cases if c.out_scale is not None]
    outs = interpret(cases + floats, tmp_path)
    as_float = iter(outs[len(cases) :])
    for c, got in zip(cases, outs, strict=False):
        if c.out_scale is not None:
            assert got.dtype == torch.float8_e4m3fn
            o = next(as_float)
            scaled = (o * (1.0 / c.out_scale)).clamp(-448, 448)
            assert e4m3_neighbours(got.float(), scaled).all()
            continue
        dim = c.q.shape[-1]
        want = reference_decode(
            c.q, c.kv, c.pages, c.indptr, c.last, dim**-0.5, c.k_scale, c.v_scale
        )
        # q and the KV tiles enter the dots in float16: ~1e-3 relative
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def e4m3_neighbours(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Whether each `got` is an e4m3 neighbour of x: the one below or above it (or, for an x
    whose upper neighbour is a power of two, half of that). Triton 3.8's interpreter does not
    always round to nearest (31.8 -> 16, as if the carry into the exponent were lost; ties
    away from zero), so the CPU test checks scale, saturation and masks, and the GPU test
    the hardware's rounding (tests/gpu/test_fp8_fused_gpu.py)."""
    near = x.to(torch.float8_e4m3fn)
    bits = near.view(torch.uint8).to(torch.int16)
    magnitude = bits & 0x7F
    away = near.float().abs() < x.abs()  # the other neighbour is further from zero
    other_mag = torch.where(away, (magnitude + 1).clamp(max=0x7E), (magnitude - 1).clamp(min=0))
    other = ((bits & 0x80) | other_mag).to(torch.uint8).view(torch.float8_e4m3fn).float()
    upper = torch.maximum(near.float().abs(), other.abs())
    lost_carry = upper == torch.exp2(torch.log2(upper).floor())
    return (
        (got == near.float())
        | (got == other)
        | (lost_carry & (got.abs() == upper / 2) & (got.sign() == x.sign()))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_interpreted_kernel_equals_the_reference_for_every_split_and_tile(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    lens = [1, 4, 9, 37, 70]  # one token, one full page, partial pages, many pages
    cases = [
        make_case(lens, 8, 2, dtype, splits, DecodeTiles(block_n, 4, 2, kv_first, prefetch))
        for splits in (1, 2, 8)  # 8 splits: some are empty for the short sequences
        for block_n, kv_first, prefetch in ((16, False, False), (32, True, True), (4, True, False))
    ]
    check(cases, tmp_path)


def test_interpreted_kernel_with_e4m3_scores_equals_the_reference_of_its_rounded_q(
    tmp_path: Path,
) -> None:
    """With scores_fp8 (S^T = K q^T over e4m3 operands, tokens as the dot's M) the only change
    is q rounded to e4m3 per head: the output equals the float32 reference over that q, for
    groups of 4 (padded to 8 rows) and 8, every split and tile, the plain launch and the
    CUDA-graph one (NewKV + Rope at an identity rotation)."""
    lens = [1, 4, 9, 37, 70]
    e4m3 = torch.float8_e4m3fn
    cases = [
        make_case(lens, heads, 2, e4m3, splits, DecodeTiles(block_n, 4, 2, scores_fp8=True))
        for heads in (8, 16)
        for splits in (1, 4)
        for block_n in (16, 32)
    ]
    c = cases[0]
    page = c.kv.shape[2]
    ends = torch.tensor(lens) - 1
    blocks = c.pages[c.indptr[:-1].long() + ends // page].int()
    offsets = (ends % page).int()
    last = c.kv[blocks.long(), :, offsets.long()].float()  # [seqs, 2, kv_heads, dim]
    k, v = last[:, 0] * c.k_scale, last[:, 1] * c.v_scale  # stored again unchanged
    rows = torch.arange(len(lens), dtype=torch.int32)
    identity = torch.cat((torch.ones(128, 16), torch.zeros(128, 16)), -1)
    graph = replace(
        c,
        new_kv=NewKV(k, v, rows, blocks, offsets),
        rope=Rope(identity, ends.int()),
    )
    outs = interpret([*cases, graph], tmp_path)
    for case, got in zip([*cases, graph], outs, strict=True):
        if case.new_kv is not None:
            got, pool = got  # the values it held, stored again (as the interpreter rounds)
            assert e4m3_neighbours(pool.float(), case.kv.float()).all()
        dim = case.q.shape[-1]
        want = reference_decode(
            rounded_to_e4m3_per_head(case.q), case.kv, case.pages, case.indptr, case.last,
            dim**-0.5, case.k_scale, case.v_scale,
        )  # fmt: skip
        # the interpreter rounds some q elements to e4m3 wrongly (e4m3_neighbours)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_interpreted_kernel_grid_orders_and_e4m3_output(tmp_path: Path) -> None:
    """The launch variants give the same attention: the grid's KV heads or sequences first,
    and an output written in e4m3 (divided by its scale; 0.02 makes some values saturate at
    448), with one split and with several (the merge writes it)."""
    lens = [1, 9, 37, 70]
    cases = [
        replace(
            make_case(lens, 8, 2, dtype, splits, DecodeTiles(16, 4, 2, True, True, first)),
            out_scale=out_scale,
        )
        for dtype in (torch.float32, torch.float8_e4m3fn)
        for splits in (1, 4)
        for first, out_scale in ((False, None), (True, None), (True, 0.02), (False, 0.125))
    ]  # fmt: skip
    check(cases, tmp_path)


def test_interpreted_kernel_groups_query_heads_and_reads_the_head_major_view(
    tmp_path: Path,
) -> None:
    tiles = DecodeTiles(16, 4, 2, True, True)
    cases = [
        make_case([5, 23], heads, kv_heads, torch.float8_e4m3fn, 2, tiles, head_major, seed=3)
        for heads, kv_heads in ((4, 4), (8, 2), (16, 2), (8, 1))  # groups of 1, 4, 8, 8
        for head_major in (False, True)
    ]
    check(cases, tmp_path)


def rope_tables(dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos_sin cache as the model lays it out, full cos, full sin) for rotate-half RoPE."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cos_sin, torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()


def rotated(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [T, heads, D] rotated at positions [T] (float32 reference)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[positions][:, None] + turned * sin[positions][:, None]


@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_interpreted_kernel_stores_the_new_kv_then_attends_over_it(
    dtype: torch.dtype, with_rope: bool, tmp_path: Path
) -> None:
    """With NewKV the launch first writes each sequence's new k/v (divided by the scales, in
    the pool's dtype) at its slot, its last token's, and attends over the pool with them;
    nothing else in the pool changes. Row 4 is a CUDA-graph padding row: it writes row 0's
    values to row 0's slot again (its output is discarded, so it is not compared). With Rope,
    q and the new k arrive unrotated and the kernel rotates them (q at its row's position, k
    at its source row's)."""
    lens = [1, 9, 37, 70, 1]
    positions = torch.tensor([0, 8, 36, 69, 0], dtype=torch.int32)  # the padding row: 0
    cos_sin, cos, sin = rope_tables(32, 128)
    cases: list[Case] = []
    stores: list[tuple[torch.Tensor, torch.Tensor]] = []
    for splits in (1, 4):
        c = make_case(lens, 8, 2, dtype, splits, DecodeTiles(16, 4, 2), seed=splits)
        page = c.kv.shape[2]
        ends = torch.tensor(lens) - 1
        blocks = c.pages[c.indptr[:-1].long() + ends // page].clone()
        offsets = (ends % page).int()
        blocks[4], offsets[4] = blocks[0], offsets[0]
        gen = torch.Generator().manual_seed(7 + splits)
        k, v = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
        rows = torch.tensor([0, 1, 2, 3, 0], dtype=torch.int32)
        rope = Rope(cos_sin, positions) if with_rope else None
        k_stored = rotated(k, positions.long(), cos, sin) if with_rope else k
        exact = c.kv.float()  # what the pool must hold afterwards, before rounding
        written = torch.zeros(exact.shape, dtype=torch.bool)
        for b in range(5):
            for i, (x, scale) in enumerate(((k_stored, c.k_scale), (v, c.v_scale))):
                slot = (int(blocks[b]), i, int(offsets[b]))
                exact[slot] = (x[int(rows[b])] / scale).clamp(-448, 448)
                written[slot] = True
        cases.append(replace(c, new_kv=NewKV(k, v, rows, blocks.int(), offsets), rope=rope))
        stores.append((exact, written))
    outs = interpret(cases, tmp_path)
    for c, (got, pool), (exact, written) in zip(cases, outs, stores, strict=True):
        assert torch.equal(pool[~written].float(), c.kv[~written].float())  # nothing else
        if dtype == torch.float8_e4m3fn:  # rounded as the interpreter rounds (see above)
            assert e4m3_neighbours(pool[written].float(), exact[written]).all()
        else:
            assert torch.equal(pool[written], exact[written])
        scale = c.q.shape[-1] ** -0.5
        q = rotated(c.q, positions.long(), cos, sin) if with_rope else c.q
        want = reference_decode(q, pool, c.pages, c.indptr, c.last, scale, c.k_scale, c.v_scale)
        torch.testing.assert_close(got[:4], want[:4], rtol=2e-3, atol=2e-3)


def test_auto_takes_a_kernel_for_an_e4m3_pool_on_cuda_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_decode_kernel("auto", "bfloat16", cuda) == "flashinfer"
    assert select_decode_kernel("flashinfer", "float8_e4m3fn", cuda) == "flashinfer"
    assert select_decode_kernel("auto", "float8_e4m3fn", cpu) == "flashinfer"
    with pytest.raises(Exception, match="runs on CUDA"):
        select_decode_kernel("triton", "float8_e4m3fn", cpu)
    with pytest.raises(ValueError, match="decode_attention"):
        select_decode_kernel("xqa8", "float8_e4m3fn", cuda)
    with pytest.raises(Exception, match="runs on CUDA"):
        select_decode_kernel("xqa", "float8_e4m3fn", cpu)
    with pytest.raises(ValueError, match="needs an fp8 KV cache"):
        select_decode_kernel("triton-e4m3-scores", "bfloat16", cuda)
    with pytest.raises(Exception, match="runs on CUDA"):
        select_decode_kernel("triton-e4m3-scores", "float8_e4m3fn", cpu)
    with pytest.raises(Exception, match=r"XQA decode needs a block size in \(16, 32, 64, 128\)"):
        select_decode_kernel("xqa", "float8_e4m3fn", cuda, page_size=8)
    with pytest.raises(Exception, match="head_dim a multiple of 16"):
        select_decode_kernel("xqa", "float8_e4m3fn", cuda, head_dim=72)


def test_splits_fill_the_gpu_and_stop_at_one_once_the_batch_does() -> None:
    assert default_splits(1, 8, 132) == MAX_SPLITS == 16  # 8 programs: as many as allowed
    assert default_splits(4, 8, 132) == 16
    assert default_splits(8, 8, 132) == 8
    assert default_splits(16, 8, 132) == 4
    assert default_splits(64, 8, 132) == 1
    assert default_splits(256, 8, 132) == 1
    for batch in (1, 3, 7, 33):
        splits = default_splits(batch, 8, 132)
        assert splits & (splits - 1) == 0 and batch * 8 * splits <= 4 * 132 * 2


def test_tiles_follow_the_pool_dtype() -> None:
    assert default_tiles(torch.float8_e4m3fn) == DecodeTiles()
    assert default_tiles(torch.float8_e4m3fn, scores_fp8=True) == DecodeTiles(scores_fp8=True)
    assert default_tiles(torch.bfloat16) == DecodeTiles(block_n=32)
    with pytest.raises(ValueError, match="e4m3 scores need an e4m3 pool"):
        default_tiles(torch.bfloat16, scores_fp8=True)
