"""The interface every attention backend implements.

A backend owns no blocks and makes no decisions: the runner stages one step's inputs
(`StepInputs`, built from the scheduler's `ScheduledBatch`), calls `prepare(step)` once, then
the model calls `forward(layer, q, k, v)` once per layer. `forward` first writes this step's
k/v into the KV cache at the tokens' slots, then returns attention of every query token over
its sequence's cached context plus the new tokens up to itself (causal within a chunk).

Invariants:
- `forward` writes exactly the slots named by the step and reads only pages listed for the
  step's sequences; nothing else in the pool changes.
- Positions [0, start_pos) of a sequence must already hold its KV (an earlier step, a prefix
  cache hit or a transfer); the backend never checks this.
- Metadata from `prepare` is valid for one step; the next `prepare` replaces it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

from engine.attention.step import StepInputs
from engine.kv.kv_cache import HEAD_MAJOR, KVCache, torch_dtype
from engine.modeling.layer_ops import RopeTables
from engine.quantization.fp8_linear import FP8_DTYPE, quantize_static
from vocabulary.model_config import ModelConfig


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (missing package, no GPU, unsupported model shape)."""


class AttentionBackend(abc.ABC):
    """Paged attention over one worker's KV cache for the Llama-family model."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(
        self, model_cfg: ModelConfig, kv_cache: KVCache, compute_dtype: torch.dtype | None = None
    ) -> None:
        """`compute_dtype`: q's dtype (the model's; default the pool's, which an e4m3 pool
        cannot be)."""
        spec = kv_cache.spec
        if (spec.num_kv_heads, spec.head_dim, spec.num_layers) != (
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            model_cfg.num_layers,
        ):
            raise ValueError(f"KV cache {spec} does not fit the model {model_cfg.model_type}")
        self.model_cfg = model_cfg
        self.kv_cache = kv_cache
        self.block_size = spec.block_size
        self.kv_dtype = torch_dtype(spec.dtype)
        self.dtype = compute_dtype or self.kv_dtype
        if self.dtype == FP8_DTYPE:
            raise ValueError("an e4m3 KV pool needs the model's compute dtype for q")
        self.num_heads = model_cfg.num_heads
        self.num_kv_heads = model_cfg.num_kv_heads
        self.head_dim = model_cfg.head_dim
        self.scale = model_cfg.head_dim**-0.5
        self._fp8_store: Callable[..., None] | None = None
        """An e4m3 block- or layer-major pool on CUDA: the fused quantize-and-store kernel
        (engine/quantization/fp8_kernels.py); a head-major one writes through the per-layer view."""
        heads_run = spec.layout != HEAD_MAJOR  # the kernel writes a token's heads as one run
        if self.kv_dtype == FP8_DTYPE and kv_cache.device.type == "cuda" and heads_run:
            from engine.quantization import fp8_kernels

            if fp8_kernels.unavailable_reason() is None:
                self._fp8_store = fp8_kernels.store_kv

    @abc.abstractmethod
    def prepare(self, step: StepInputs) -> None:
        """Build this step's attention metadata (once per step, before the first layer)."""

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] at the step's slots; return attention [T, Hq, D] (in q's
        dtype, or, given `out_scale`, possibly divided by it in e4m3: see model.Attend)."""

    def write_kv(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's k/v of one layer at their slots (an index_put on the pool view)."""
        kv = self.kv_cache.layer(layer)
        blocks, offsets = step.slot_blocks, step.slot_offsets
        if kv.dtype == FP8_DTYPE and self._fp8_store is not None:  # one fused launch
            self._fp8_store(
                kv, blocks, offsets, k, v,
                self.kv_cache.spec.layer_scales(layer), step.write_rows,
            )  # fmt: skip
            return
        if step.write_rows is not None:
            k, v = k[step.write_rows], v[step.write_rows]
        if kv.dtype == FP8_DTYPE:  # stored as K / k_scale (engine/loading/fp8_calibration.py)
            k_scale, v_scale = self.kv_cache.spec.layer_scales(layer)
            k, v = quantize_static(k, k_scale), quantize_static(v, v_scale)
        kv[:, 0].index_put_((blocks, offsets), k.to(kv.dtype))
        kv[:, 1].index_put_((blocks, offsets), v.to(kv.dtype))

    # CUDA-graph decode (backends with supports_cuda_graphs only) ---------------------------

    def graph_rope(self, tables: RopeTables) -> bool:
        """Offer this backend the model's RoPE tables for its CUDA-graph decode steps: True
        when it will then rotate q and k itself there (graph steps' forward gets them
        unrotated: the model skips its RoPE op, `LlamaModel.forward(rope_in_attention=...)`).
        The default declines."""
        del tables
        return False

    def init_decode_graphs(self, max_batch: int, max_pages: int) -> None:
        """Allocate the fixed buffers graph-captured decode steps of up to max_batch
        sequences and max_pages pages in total will use."""
        raise BackendUnavailable(f"attention backend {self.name!r} has no CUDA-graph mode")

    def prepare_decode_graph(self, step: StepInputs, batch_size: int) -> None:
        """Plan a padded decode-only step of exactly `batch_size` sequences whose device
        inputs live in fixed buffers; the following `forward` calls (captured or not) use
        the graph-mode kernels of that batch size."""
        raise BackendUnavailable(f"attention backend {self.name!r} has no CUDA-graph mode")
