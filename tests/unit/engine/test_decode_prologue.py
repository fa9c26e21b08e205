"""The graph decode's prologue for XQA (engine/attention/decode_prologue.py): q rotated and
made contiguous, the new k (rotated) and v stored at their slots divided by the layer's
scales, in Triton's interpreter on CPU (GPU: tests/gpu/test_fp8_fused_gpu.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch
import triton_interpret
from test_triton_decode import e4m3_neighbours, rope_tables, rotated

from engine.attention.triton_decode import NewKV, Rope


@dataclass(frozen=True)
class Case:
    qkv: torch.Tensor
    """The qkv projection's output [tokens, (heads + 2 kv_heads) * dim]: q, k, v are views."""
    heads: int
    kv_heads: int
    pool: torch.Tensor
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    k_scale: float
    v_scale: float
    rope: Rope | None

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dim = self.pool.shape[-1]
        q, k, v = self.qkv.split(
            (self.heads * dim, self.kv_heads * dim, self.kv_heads * dim), dim=-1
        )
        t = self.qkv.shape[0]
        return q.view(t, -1, dim), k.view(t, -1, dim), v.view(t, -1, dim)


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from engine.attention.decode_prologue import decode_prologue

    outs = []
    for c in cast(list[Case], torch.load(inputs, weights_only=False)):
        q, k, v = c.views()
        new_kv = NewKV(k, v, c.rows, c.blocks, c.offsets)
        q_out = decode_prologue(q, new_kv, c.pool, c.k_scale, c.v_scale, c.rope)
        outs.append((q_out, c.pool))
    torch.save(outs, outputs)


def make_case(
    dtype: torch.dtype, pool_dtype: torch.dtype, heads: int, kv_heads: int, with_rope: bool
) -> Case:
    """Five rows (row 4 a CUDA-graph padding row: row 0's k/v to row 0's slot again) over a
    3-layer pool's layer 1, pages of 4 tokens of dim 32."""
    gen = torch.Generator().manual_seed(heads + 10 * with_rope)
    dim, page, blocks = 32, 4, 6
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen).mul(3).to(dtype)
    full = torch.randn(blocks, 3, 2, page, kv_heads, dim, generator=gen).to(pool_dtype)
    rows = torch.tensor([0, 1, 2, 3, 0], dtype=torch.int32)
    blocks_at = torch.tensor([2, 5, 0, 3, 2], dtype=torch.int32)
    offsets = torch.tensor([1, 3, 0, 2, 1], dtype=torch.int32)
    cos_sin = rope_tables(dim, 64)[0]
    positions = torch.tensor([5, 15, 0, 62, 0], dtype=torch.int32)
    rope = Rope(cos_sin, positions) if with_rope else None
    return Case(qkv, heads, kv_heads, full[:, 1], rows, blocks_at, offsets, 0.5, 0.25, rope)


@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float8_e4m3fn)],
)
def test_prologue_rotates_q_and_stores_the_new_kv(
    dtype: torch.dtype, pool_dtype: torch.dtype, with_rope: bool, tmp_path: Path
) -> None:
    """8/2 heads (a group of 4) and 6/2 (a group of 3, padded to 4 rows): q comes back
    contiguous and rotated at its row's position; each row's k (rotated at its source row's
    position) and v land at its slot divided by the scales, in the pool's dtype; nothing
    else in the pool changes."""
    cases = [make_case(dtype, pool_dtype, h, 2, with_rope) for h in (8, 6)]
    outs = triton_interpret.interpret(__file__, cases, tmp_path)
    _, cos, sin = rope_tables(32, 64)
    for c, (q_out, pool) in zip(cases, outs, strict=True):
        q, k, v = (x.float() for x in c.views())
        if c.rope is not None:
            pos = c.rope.positions.long()
            q = rotated(q, pos, cos, sin)
            k = rotated(k, pos, cos, sin)
        assert q_out.is_contiguous() and q_out.dtype == dtype
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # within one bf16 rounding
        torch.testing.assert_close(q_out.float(), q, rtol=ulp, atol=1e-5)
        exact = c.pool.float().clone()
        written = torch.zeros(exact.shape, dtype=torch.bool)
        for b in range(5):
            for i, (x, scale) in enumerate(((k, c.k_scale), (v, c.v_scale))):
                slot = (int(c.blocks[b]), i, int(c.offsets[b]))
                exact[slot] = (x[int(c.rows[b])] / scale).clamp(-448, 448)
                written[slot] = True
        assert torch.equal(pool[~written].float(), c.pool[~written].float())
        if pool_dtype == torch.float8_e4m3fn:  # the interpreter's rounding (test_triton_decode)
            assert e4m3_neighbours(pool[written].float(), exact[written]).all()
        else:
            torch.testing.assert_close(pool[written], exact[written], rtol=1e-5, atol=1e-5)


def test_prologue_refuses_a_q_out_of_another_shape() -> None:
    from engine.attention.decode_prologue import decode_prologue

    c = make_case(torch.float32, torch.float32, 8, 2, False)
    q, k, v = c.views()
    with pytest.raises(ValueError, match="q_out must be a contiguous"):
        decode_prologue(
            q, NewKV(k, v, c.rows, c.blocks, c.offsets), c.pool, 1.0, 1.0,
            q_out=torch.empty(4, 8, 32),
        )  # fmt: skip
