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

Single-token decodes over an e4m3 pool go to flashinfer's XQA (TensorRT-LLM's GQA decode,
xqa_decode.py) on SM90, or to the Triton split-KV kernel (engine/attention/triton_decode.py)
elsewhere or when asked (`EngineConfig.decode_attention`). Both read the staged device page
arrays directly (no host plan). On the H200, over the 70B shape's B=64 x 2048 e4m3 KV, XQA
reads at 1.31x its floor, the Triton kernel at 1.54x and flashinfer's decode at 1.83x
(`python -m benchmarks attention`). In a CUDA-graph step the Triton launch also stores the
step's k/v (no store kernel), rotates q and k (the backend takes `graph_rope`, so the model
runs no RoPE op there) and writes o_proj's e4m3 input when the model passes that
projection's static scale (`out_scale`, model.Attend); XQA's graph step stores and rotates
in one prologue launch before it (decode_prologue.py) and XQA writes o_proj's e4m3 input
itself.

Kernel choice is pinned to fa2: "auto" may pick fa3 (a 100 s JIT on the H200), cuDNN or XQA
routes whose constraints differ. Plans take host (CPU) copies of the small indptr arrays
(flashinfer schedules on the host) and the device page list staged by the runner.

CUDA graphs: one decode wrapper per captured batch size in flashinfer's CUDA-graph mode. They
share one set of fixed indptr / last-page / page-index buffers (only one graph replays at a
time) and, with the eager wrappers, one float workspace (runs never overlap: one stream).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention.base import AttentionBackend, BackendUnavailable
from engine.attention.flashinfer_probe import flashinfer_unavailable_reason
from engine.attention.step import StepInputs
from engine.config import DECODE_ATTENTION_CHOICES
from engine.kv.kv_cache import FP8_KV_DTYPE, KVCache
from engine.modeling.layer_ops import RopeTables
from engine.quantization.fp8_linear import FP8_DTYPE
from vocabulary.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.attention.triton_decode import PagedDecode
    from engine.attention.xqa_decode import XqaDecode

WORKSPACE_BYTES = 256 << 20
"""flashinfer's float workspace (split-KV partial outputs); 128 MiB is its recommendation."""

KERNEL_BACKEND = "fa2"
TRITON_E4M3_SCORES = "triton-e4m3-scores"


def select_decode_kernel(
    requested: str, kv_dtype: str, device: torch.device, page_size: int = 16, head_dim: int = 128
) -> str:
    """The decode kernel for `requested` (EngineConfig.decode_attention). auto: flashinfer's
    for a float pool; for an e4m3 pool XQA on SM90 where it builds (`xqa_unavailable_reason`),
    else Triton (when triton imports), else flashinfer's. Why XQA there: its TMA +
    warpgroup-MMA FP8 kernel reads the e4m3 pool at 1.31x its floor on the H200 against the
    Triton kernel's 1.54x (docs/benchmarks.md, "FP8, 2026-12-05 (fifth session)").
    triton-e4m3-scores is Triton's kernel with e4m3 scores, for an e4m3 pool only; xqa is
    flashinfer's XQA (refused where it cannot run)."""
    if requested == "flashinfer":
        return requested
    if requested not in DECODE_ATTENTION_CHOICES:
        choices = ", ".join(DECODE_ATTENTION_CHOICES)
        raise ValueError(f"decode_attention: one of {choices}, got {requested!r}")
    if requested == "xqa" or (requested == "auto" and kv_dtype == FP8_KV_DTYPE):
        from engine.attention.xqa_decode import xqa_unavailable_reason

        why = xqa_unavailable_reason(device, page_size, head_dim)
        if requested == "xqa" and why is not None:
            raise BackendUnavailable(why)
        sm90 = why is None and torch.cuda.get_device_capability(device)[0] == 9
        if requested == "xqa" or sm90:
            return "xqa"
    if requested == TRITON_E4M3_SCORES:
        if kv_dtype != FP8_KV_DTYPE:
            raise ValueError(f"decode_attention {requested} needs an fp8 KV cache, got {kv_dtype}")
        requested = "triton"
    if requested == "auto" and kv_dtype != FP8_KV_DTYPE:
        return "flashinfer"
    reason = None
    if device.type != "cuda":
        reason = f"the Triton decode kernel runs on CUDA (got {device})"
    else:
        try:
            import engine.attention.triton_decode  # noqa: F401  (compiles at first use)
        except Exception as e:  # an optional dependency: any import failure means "not here"
            reason = f"the Triton decode kernel needs triton, which does not import: {e}"
    if reason is None:
        return "triton"
    if requested == "triton":
        raise BackendUnavailable(reason)
    return "flashinfer"


def _host(values: np.ndarray) -> torch.Tensor:
    """A fresh CPU int32 tensor (flashinfer reads it on the host and copies it itself)."""
    return torch.from_numpy(np.array(values, dtype=np.int32))


class FlashInferBackend(AttentionBackend):
    """Prefill + decode wrappers over the paged pool (see the module docstring)."""

    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(
        self,
        model_cfg: ModelConfig,
        kv_cache: KVCache,
        compute_dtype: torch.dtype | None = None,
        decode_attention: str = "auto",
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
        self.decode_kernel = select_decode_kernel(
            decode_attention, kv_cache.spec.dtype, kv_cache.device, self.block_size,
            self.head_dim,
        )  # fmt: skip
        self._scores_fp8 = decode_attention == TRITON_E4M3_SCORES
        self._xqa: XqaDecode | None = None
        if self.decode_kernel == "xqa":
            from engine.attention.xqa_decode import XqaDecode

            self._xqa = XqaDecode(self.device, self.block_size)
        self._triton: dict[tuple[int, bool], PagedDecode] = {}
        """(batch, for a graph) → the Triton decode launch of that batch size."""
        self._graph_rope: torch.Tensor | None = None
        """The cos/sin cache when graph decodes rotate q/k in the Triton kernel (or XQA's
        prologue launch)."""
        self._graph_wrappers: dict[int, Any] = {}
        self._out_scales: dict[int, tuple[torch.Tensor, float]] = {}
        """layer → (o_proj's input scale, its value) for XQA's e4m3 output in graph steps."""
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
        if self._has_decode and self._xqa is not None:
            self._xqa.stage(step, npf, graph=False)
        if self._has_decode and self.decode_kernel == "flashinfer":
            first_page = int(lay.kv_indptr[npf])
            self._decode.plan(
                _host(lay.kv_indptr[npf:] - first_page),
                step.page_indices[first_page:],
                _host(lay.kv_last_page_len[npf:]),
                *heads,
                **self._plan_kwargs(),
            )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self._step is not None, "prepare() must run before forward()"
        pool = self.kv_cache.layer(layer)
        if self._graph_batch is not None and self.decode_kernel in ("triton", "xqa"):
            return self._graph_fused_decode(layer, q, k, v, pool, out_scale)
        self.write_kv(layer, self._step, k, v)
        q = q.contiguous()
        scales = self._scales(layer)
        if self._graph_batch is not None:
            return self._graph_wrappers[self._graph_batch].run(q, pool, **scales)
        if not self._has_decode:
            return self._prefill.run(q, pool, **scales)
        out = torch.empty_like(q)
        t = self._split
        if self._has_prefill:
            self._prefill.run(q[:t], pool, out=out[:t], **scales)
        if self.decode_kernel == "triton":
            self._triton_decode(layer, q[t:], pool, out[t:])
        elif self._xqa is not None:
            self._xqa_decode(layer, q[t:], pool, out[t:])
        else:
            self._decode.run(q[t:], pool, out=out[t:], **scales)
        return out

    def _triton_kernel(self, batch: int, graph: bool) -> PagedDecode:
        from engine.attention.triton_decode import PagedDecode, default_tiles, splits_for

        kernel = self._triton.get((batch, graph))
        if kernel is None:
            heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
            splits = splits_for(batch, self.num_kv_heads, self.device)
            tiles = default_tiles(self.kv_dtype, self._scores_fp8)
            kernel = PagedDecode(batch, *heads, self.device, splits, tiles)
            self._triton[(batch, graph)] = kernel
        return kernel

    def _triton_decode(
        self, layer: int, q: torch.Tensor, pool: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The decodes of an eager step: sequences [num_prefill_seqs, n) of the staged page
        arrays (absolute page offsets, so the full page list is passed)."""
        assert self._step is not None
        step, npf = self._step, self._step.layout.num_prefill_seqs
        assert step.kv_indptr is not None and step.kv_last_page_len is not None
        k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
        self._triton_kernel(q.shape[0], False).run(
            q, pool, step.page_indices, step.kv_indptr[npf:], step.kv_last_page_len[npf:],
            self.scale, k_scale, v_scale, out=out,
        )  # fmt: skip

    def _xqa_decode(
        self, layer: int, q: torch.Tensor, pool: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """The step's decodes through XQA, over the page table `prepare` (or
        `prepare_decode_graph`) staged."""
        assert self._xqa is not None
        k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
        return self._xqa.run(q, pool, self.scale, k_scale, v_scale, out)

    def _graph_fused_decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: torch.Tensor,
        out_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """A graph step's decodes, storing the step's k/v first (at the step's slots, padding
        rows writing row 0's: `StepInputs.write_rows`) and rotating q and k when the backend
        took `graph_rope`. Triton: one launch that also attends, reading q's strided view of
        the qkv output, and writes o_proj's e4m3 input itself with `out_scale`. XQA: one
        prologue launch that stores, rotates and copies q out (decode_prologue.py), then XQA,
        writing o_proj's e4m3 input itself when `out_scale` is known on the host."""
        from engine.attention.triton_decode import NewKV, Rope

        step, batch = self._step, self._graph_batch
        assert step is not None and step.write_rows is not None and batch is not None
        k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
        new_kv = NewKV(k, v, step.write_rows, step.slot_blocks, step.slot_offsets)
        rope = None if self._graph_rope is None else Rope(self._graph_rope, step.positions)
        if self._xqa is None:
            assert self._graph_buffers is not None
            indptr, last, pages = self._graph_buffers
            return self._triton_kernel(batch, True).run(
                q, pool, pages, indptr[: batch + 1], last[:batch], self.scale, k_scale,
                v_scale, out_scale=out_scale, new_kv=new_kv, rope=rope,
            )  # fmt: skip
        from engine.attention.decode_prologue import decode_prologue

        q = decode_prologue(q, new_kv, pool, k_scale, v_scale, rope)
        host_scale = self._host_out_scale(layer, out_scale)
        if host_scale is None:  # q's dtype: the model casts it for o_proj
            out, host_scale = torch.empty_like(q), 1.0
        else:
            out = torch.empty(q.shape, dtype=FP8_DTYPE, device=q.device)
        return self._xqa.run(q, pool, self.scale, k_scale, v_scale, out, host_scale)

    def _host_out_scale(self, layer: int, out_scale: torch.Tensor | None) -> float | None:
        """`out_scale`'s value on the host for XQA's e4m3 output (a static scale, read once
        per layer: by the warm-up step before a graph's capture, never inside one); None when
        there is none or it is not read yet (the model then casts XQA's output itself)."""
        if out_scale is None or self.kv_dtype != FP8_DTYPE:
            return None
        known = self._out_scales.get(layer)
        if known is not None and known[0] is out_scale:
            return known[1]
        if torch.cuda.is_current_stream_capturing():
            return None
        value = float(out_scale.item())
        self._out_scales[layer] = (out_scale, value)
        return value

    def graph_rope(self, tables: RopeTables) -> bool:
        """The Triton decode rotates q and the new k in its launch, and so does the XQA graph
        step's prologue (one RoPE kernel a layer fewer); flashinfer's graph decode does not."""
        if self.decode_kernel not in ("triton", "xqa"):
            return False
        self._graph_rope = tables.cos_sin_cache
        return True

    def init_decode_graphs(self, max_batch: int, max_pages: int) -> None:
        dev = self.device
        if self._xqa is not None:
            self._xqa.init_graphs(max_batch, max_pages // max_batch)
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
        if self._xqa is not None:  # the graph reads its page table and lengths buffers
            self._xqa.stage(step, 0, graph=True)
            self._step, self._graph_batch = step, batch_size
            return
        if self.decode_kernel == "triton":  # the graph reads these buffers (device copies)
            assert step.kv_indptr is not None and step.kv_last_page_len is not None
            indptr, last, pages = self._graph_buffers
            indptr[: batch_size + 1].copy_(step.kv_indptr)
            last[:batch_size].copy_(step.kv_last_page_len)
            pages[: lay.num_pages].copy_(step.page_indices)
            self._step, self._graph_batch = step, batch_size
            return
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
