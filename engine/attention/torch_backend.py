"""Reference attention in plain torch: any device, any dtype, exact in float32.

Per sequence it gathers the pages of its context from the paged pool (after this step's k/v
are written), then runs scaled-dot-product attention of the chunk's queries over them with a
causal mask offset by start_pos (query i sees keys [0, start_pos + i]); grouped-query heads
share their KV head. Prompt chunks get one attention call each; the single-token decodes of a
step are batched into one call over their contexts padded to the longest (padding masked out),
since per-sequence calls dominate a decode step on CPU. Clear rather than fast, and the
yardstick the flashinfer backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.attention.step import StepInputs


@dataclass(frozen=True)
class _Decodes:
    """The step's single-token decodes, padded to one batch: rows [first_row, T)."""

    first_row: int
    pages: torch.Tensor  # [S, max_pages] page ids (padding repeats a real page, masked out)
    mask: torch.Tensor  # [S, 1, 1, max_pages * block_size] True where a key is in context


@dataclass(frozen=True)
class _Seq:
    rows: slice  # query rows in the flat batch
    pages: torch.Tensor  # page ids of the context (device)
    kv_len: int
    start_pos: int


def _dequant(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool values in `dtype` (an e4m3 pool stores value / scale; a float pool has scale 1)."""
    if scale == 1.0:
        return t.to(dtype)
    return (t.float() * scale).to(dtype)


class TorchAttentionBackend(AttentionBackend):
    """Gather-and-attend per sequence (see the module docstring)."""

    name = "torch"

    def prepare(self, step: StepInputs) -> None:
        lay = step.layout
        qo, kv = lay.qo_indptr.tolist(), lay.kv_indptr.tolist()
        self._step = step
        first = lay.num_prefill_seqs
        self._decodes = self._batch_decodes(step, first) if lay.num_seqs - first >= 2 else None
        last = first if self._decodes is not None else lay.num_seqs
        self._seqs = [
            _Seq(
                rows=slice(qo[i], qo[i + 1]),
                pages=step.page_indices[kv[i] : kv[i + 1]],
                kv_len=int(lay.kv_lens[i]),
                start_pos=int(lay.start_pos[i]),
            )
            for i in range(last)
        ]

    def _batch_decodes(self, step: StepInputs, first: int) -> _Decodes:
        lay = step.layout
        kv, lens = lay.kv_indptr, lay.kv_lens
        n_pages = [int(kv[i + 1] - kv[i]) for i in range(first, lay.num_seqs)]
        width = max(n_pages)
        table = torch.zeros((len(n_pages), width), dtype=torch.long)
        for row, i in enumerate(range(first, lay.num_seqs)):
            pages = torch.from_numpy(lay.page_indices[kv[i] : kv[i + 1]].astype(np.int64))
            table[row, : n_pages[row]] = pages
            table[row, n_pages[row] :] = pages[0]
        device = step.page_indices.device
        keys = torch.arange(width * lay.block_size)[None, :]
        mask = keys < torch.from_numpy(lens[first:].astype(np.int64))[:, None]
        return _Decodes(
            first_row=int(lay.qo_indptr[first]),
            pages=table.to(device),
            mask=mask[:, None, None, :].to(device),
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write_kv(layer, self._step, k, v)
        pool = self.kv_cache.layer(layer)  # [blocks, 2, block_size, Hkv, D]
        k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
        out = torch.empty_like(q)
        for s in self._seqs:
            ctx = pool[s.pages]  # [pages, 2, block_size, Hkv, D]
            keys = ctx[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[: s.kv_len]
            values = ctx[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[: s.kv_len]
            keys, values = _dequant(keys, k_scale, q.dtype), _dequant(values, v_scale, q.dtype)
            out[s.rows] = self._attend(q[s.rows], keys, values, s)
        if self._decodes is not None:
            d = self._decodes
            ctx = pool[d.pages]  # [S, pages, 2, block_size, Hkv, D]
            n, width = ctx.shape[0], ctx.shape[1] * ctx.shape[3]
            keys = ctx[:, :, 0].reshape(n, width, self.num_kv_heads, self.head_dim)
            values = ctx[:, :, 1].reshape(n, width, self.num_kv_heads, self.head_dim)
            qd = q[d.first_row :].unsqueeze(2)  # [S, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd,
                _dequant(keys.transpose(1, 2), k_scale, q.dtype),
                _dequant(values.transpose(1, 2), v_scale, q.dtype),
                attn_mask=d.mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[d.first_row :] = o.squeeze(2)
        return out

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: _Seq
    ) -> torch.Tensor:
        n = q.shape[0]
        qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
        gqa = self.num_heads != self.num_kv_heads
        if n == 1:  # a decode: the one query sees the whole context
            o = F.scaled_dot_product_attention(qh, kh, vh, scale=self.scale, enable_gqa=gqa)
        elif s.start_pos == 0:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            rows = torch.arange(n, device=q.device)[:, None] + s.start_pos
            mask = torch.arange(s.kv_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        return o.transpose(0, 1)
