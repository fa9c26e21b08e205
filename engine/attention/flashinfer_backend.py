"""flashinfer paged attention on the strided per-layer view of the block-major pool (GPU only).

Per step, `prepare` plans two wrappers once and every layer reuses the plans:
- multi-token chunks (prompt chunks, with or without a cached prefix) go to
  `BatchPrefillWithPagedKVCacheWrapper` with causal=True; flashinfer aligns the causal
  diagonal to the end of each sequence's KV, so query i of a chunk sees positions
  [0, start_pos + i];
- single-token decodes go to `BatchDecodeWithPagedKVCacheWrapper` with tensor cores (faster
  for grouped-query attention).
Both read `kv_cache.layer(i)` ([blocks, 2, block_size, Hkv, D], flashinfer's NHD paged
layout; K and V share strides, so the standard kernels apply). KV is written with an
index_put on that view before attention.

Kernel choice is pinned to fa2: "auto" may pick fa3 (a 100 s JIT on the H200), cuDNN or XQA
routes whose constraints differ. Plans take host (CPU) copies of the small indptr arrays
(flashinfer schedules on the host) and the device page list staged by the runner.

CUDA graphs: one decode wrapper per captured batch size in flashinfer's CUDA-graph mode. They
share one set of fixed indptr / last-page / page-index buffers (only one graph replays at a
time) and, with the eager wrappers, one float workspace (runs never overlap: one stream).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionBackend, BackendUnavailable
from engine.attention.registry import flashinfer_unavailable_reason
from engine.attention.step import StepInputs
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig

WORKSPACE_BYTES = 256 << 20
"""flashinfer's float workspace (split-KV partial outputs); 128 MiB is its recommendation."""

KERNEL_BACKEND = "fa2"


def _host(values: np.ndarray) -> torch.Tensor:
    """A fresh CPU int32 tensor (flashinfer reads it on the host and copies it itself)."""
    return torch.from_numpy(np.array(values, dtype=np.int32))


class FlashInferBackend(AttentionBackend):
    """Prefill + decode wrappers over the paged pool (see the module docstring)."""

    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self, model_cfg: ModelConfig, kv_cache: KVCache, compute_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(model_cfg, kv_cache, compute_dtype)
        reason = flashinfer_unavailable_reason(model_cfg, kv_cache.device, self.dtype)
        if reason is not None:
            raise BackendUnavailable(reason)
        import flashinfer

        self._fi: Any = flashinfer
        self.device = kv_cache.device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=KERNEL_BACKEND
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend=KERNEL_BACKEND
        )
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_batch: int | None = None
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step: StepInputs | None = None
        self._split = 0
        self._has_prefill = self._has_decode = False

    def _plan_kwargs(self) -> dict[str, Any]:
        return {"q_data_type": self.dtype, "kv_data_type": self.kv_dtype, "sm_scale": self.scale}

    def _scales(self, layer: int) -> dict[str, float]:
        """An e4m3 pool's dequantization scales for flashinfer's run (none for a float pool:
        the kernels then skip the multiply)."""
        if not self.kv_cache.spec.scales:
            return {}
        k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
        return {"k_scale": k_scale, "v_scale": v_scale}

    def prepare(self, step: StepInputs) -> None:
        lay = step.layout
        n, npf = lay.num_seqs, lay.num_prefill_seqs
        self._step, self._graph_batch = step, None
        self._has_prefill, self._has_decode = npf > 0, npf < n
        self._split = lay.num_prefill_tokens
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        if self._has_prefill:
            kv_indptr = lay.kv_indptr[: npf + 1]
            self._prefill.plan(
                _host(lay.qo_indptr[: npf + 1]),
                _host(kv_indptr),
                step.page_indices[: int(kv_indptr[-1])],
                _host(lay.kv_last_page_len[:npf]),
                *heads,
                causal=True,
                **self._plan_kwargs(),
            )
        if self._has_decode:
            first_page = int(lay.kv_indptr[npf])
            self._decode.plan(
                _host(lay.kv_indptr[npf:] - first_page),
                step.page_indices[first_page:],
                _host(lay.kv_last_page_len[npf:]),
                *heads,
                **self._plan_kwargs(),
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self._step is not None, "prepare() must run before forward()"
        self.write_kv(layer, self._step, k, v)
        pool = self.kv_cache.layer(layer)
        q = q.contiguous()
        scales = self._scales(layer)
        if self._graph_batch is not None:
            return self._graph_wrappers[self._graph_batch].run(q, pool, **scales)
        if not self._has_decode:
            return self._prefill.run(q, pool, **scales)
        if not self._has_prefill:
            return self._decode.run(q, pool, **scales)
        out = torch.empty_like(q)
        t = self._split
        self._prefill.run(q[:t], pool, out=out[:t], **scales)
        self._decode.run(q[t:], pool, out=out[t:], **scales)
        return out

    def init_decode_graphs(self, max_batch: int, max_pages: int) -> None:
        dev = self.device
        self._graph_buffers = (
            torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),  # kv indptr
            torch.ones(max_batch, dtype=torch.int32, device=dev),  # last page len
            torch.zeros(max_pages, dtype=torch.int32, device=dev),  # page indices
        )

    def prepare_decode_graph(self, step: StepInputs, batch_size: int) -> None:
        if self._graph_buffers is None:
            raise RuntimeError("init_decode_graphs() must run before prepare_decode_graph()")
        lay = step.layout
        if lay.num_seqs != batch_size or lay.num_tokens != batch_size:
            raise ValueError(f"a graph step of size {batch_size} got {lay.num_seqs} sequences")
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            indptr, last, pages = self._graph_buffers
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[: batch_size + 1],
                paged_kv_indices_buffer=pages,
                paged_kv_last_page_len_buffer=last[:batch_size],
                backend=KERNEL_BACKEND,
            )
            self._graph_wrappers[batch_size] = wrapper
        wrapper.plan(
            _host(lay.kv_indptr),
            step.page_indices,
            _host(lay.kv_last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            **self._plan_kwargs(),
        )
        self._step, self._graph_batch = step, batch_size
