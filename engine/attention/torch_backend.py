"""Reference attention in plain torch: any device, any dtype, exact in float32.

Per sequence it gathers the pages of its context from the paged pool (after this step's k/v
are written), then runs scaled-dot-product attention of the chunk's queries over them with a
causal mask offset by start_pos (query i sees keys [0, start_pos + i]); grouped-query heads
share their KV head. One small attention call per sequence: clear rather than fast, and the
yardstick the flashinfer backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.attention.step import StepInputs


@dataclass(frozen=True)
class _Seq:
    rows: slice  # query rows in the flat batch
    pages: torch.Tensor  # page ids of the context (device)
    kv_len: int
    start_pos: int


class TorchAttentionBackend(AttentionBackend):
    """Gather-and-attend per sequence (see the module docstring)."""

    name = "torch"

    def prepare(self, step: StepInputs) -> None:
        lay = step.layout
        qo, kv = lay.qo_indptr.tolist(), lay.kv_indptr.tolist()
        self._step = step
        self._seqs = [
            _Seq(
                rows=slice(qo[i], qo[i + 1]),
                pages=step.page_indices[kv[i] : kv[i + 1]],
                kv_len=int(lay.kv_lens[i]),
                start_pos=int(lay.start_pos[i]),
            )
            for i in range(lay.num_seqs)
        ]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.write_kv(layer, self._step, k, v)
        pool = self.kv_cache.layer(layer)  # [blocks, 2, block_size, Hkv, D]
        out = torch.empty_like(q)
        for s in self._seqs:
            ctx = pool[s.pages]  # [pages, 2, block_size, Hkv, D]
            keys = ctx[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[: s.kv_len]
            values = ctx[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[: s.kv_len]
            out[s.rows] = self._attend(q[s.rows], keys.to(q.dtype), values.to(q.dtype), s)
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
