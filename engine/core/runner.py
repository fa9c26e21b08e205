"""The model runner: executes one `ScheduledBatch` and returns the logits to sample from.

The runner owns tensors, never decisions: the scheduler says which tokens to compute and
where their KV lives (block tables), the runner stages that on the device (one host→device
copy per step), runs the model with the chosen attention backend (which writes the step's
KV into the pool and attends over the cached context) and computes logits only for chunks
with sample=True. Decode-only steps replay CUDA graphs on GPU when enabled (a pipeline stage's
too: its layers' part, `execute_stage`).

Overlap scheduling (engine/core/overlap.py): `execute` only queues work on the device and returns
(no host sync). A chunk marked `placeholder` is the decode of a token the previous step is
still sampling: it is staged as 0 and its row is overwritten on the device with that step's
sampled id, which the engine hands over with `keep_sampled` after sampling each step. Before
a step's attention plan rewrites a pinned buffer that the previous plan's copy may not have
read yet, the runner waits for that copy (an event, not a device drain).

LoRA (engine/lora/lora_apply.py): with `lora_weights` (the adapter cache's device slots) each chunk
reads the slot its `lora_slot` names (-1: the base model), expanded here to one slot per
token. A step in which no chunk reads a slot runs exactly the base path (no LoRA work, the
base CUDA graphs); otherwise eager steps add the deltas grouped by slot, and decode steps
replay a second set of CUDA graphs whose inputs carry the per-token slots.

The layer ops (torch math or flashinfer's fused kernels, engine/modeling/layer_ops.py) are chosen
once, at construction, by `create_layer_ops` (which self-checks the fused ones); if capturing the
CUDA graphs with fused ops fails, the runner falls back to torch ops and captures again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine.attention import (
    BatchLayout,
    StepInputs,
    StepStager,
    build_layout,
    check_bounds,
    create_backend,
)
from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.cuda_graphs import DecodeGraphs
from engine.device import to_device
from engine.kv.kv_cache import KVCache, torch_dtype
from engine.lora.lora_apply import LoraStep, LoraWeights, eager_step
from engine.modeling.layer_ops import TORCH_OPS, LayerOps
from engine.modeling.layer_ops_select import create_layer_ops
from engine.modeling.llama import LlamaModel
from vocabulary.numeric import cdiv

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """EngineConfig.device → torch device ("auto": cuda when available, else cpu).

    A CUDA device always gets an explicit index (the current device for "cuda"), because
    the KV pool's device is handed to code that needs one (NIXL registration, set_device).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """EngineConfig.dtype → torch dtype ("auto": bfloat16 on GPU, float32 on CPU)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(name)


class ModelRunner:
    """Runs scheduled steps of one model over one KV pool.

    Contract of `execute` (what the scheduler guarantees):
    - every chunk has >= 1 token; positions [0, start_pos) of its sequence are in the pool;
    - block_ids covers at least start_pos + num_tokens positions (slot of position p is
      block_ids[p // block_size] * block_size + p % block_size);
    - within a step no two chunks write the same slot, and no chunk writes a block another
      sequence reads as a shared (prefix-cached) block;
    - multi-token chunks come before single-token ones (any order is correct; this one lets
      flashinfer run decodes with its decode kernel);
    - a chunk's lora_slot is -1 or a slot of `lora_weights` that the chunk's request holds
      (`LoraCache.acquire`), so the slot's weights stay put until the step has run.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        config: EngineConfig,
        lora_weights: LoraWeights | None = None,
    ) -> None:
        """`lora_weights`: the adapter cache's device slots (`LoraCache.weights`), made before
        this runner (its CUDA graphs hold their addresses); None serves the base model only."""
        if kv_cache.spec.block_size != config.block_size:
            raise ValueError(
                f"KV cache block size {kv_cache.spec.block_size} != config {config.block_size}"
            )
        kv_dtype_ok = kv_cache.tensor.dtype in (model.dtype, torch.float8_e4m3fn)
        same_device = resolve_device(str(kv_cache.device)) == resolve_device(str(model.device))
        if not kv_dtype_ok or not same_device:  # "cuda" is the current "cuda:N"
            raise ValueError(
                f"KV cache ({kv_cache.tensor.dtype}, {kv_cache.device}) does not match the "
                f"model ({model.dtype}, {model.device})"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.block_size = config.block_size
        self.device = kv_cache.device
        self.lora = lora_weights
        self.backend = create_backend(
            config.attention_backend, model.cfg, kv_cache, model.dtype, config.decode_attention
        )
        self.layer_ops: LayerOps = create_layer_ops(config.layer_ops, model)
        self._stager = StepStager(self.device)
        self._planned: torch.cuda.Event | None = None  # the last eager plan's copies queued
        self._sampled: torch.Tensor | None = None  # `keep_sampled`: the latest step's ids
        self._sampled_rows: dict[str, int] = {}
        self.graphs: DecodeGraphs | None = None
        if (  # (a pipeline stage captures its layers' part: engine/core/cuda_graphs.py)
            config.cuda_graphs and self.device.type == "cuda" and self.backend.supports_cuda_graphs
        ):
            max_len = config.max_model_len or model.cfg.max_model_len
            max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
            self.graphs = self._capture_graphs(max_batch, cdiv(max_len, self.block_size))

    def _decode_graphs(self, max_batch: int, pages_per_seq: int, ops: LayerOps) -> DecodeGraphs:
        if self.lora is None:
            return DecodeGraphs(self.model, self.backend, max_batch, pages_per_seq, ops)
        return DecodeGraphs(self.model, self.backend, max_batch, pages_per_seq, ops, self.lora)

    def _capture_graphs(self, max_batch: int, pages_per_seq: int) -> DecodeGraphs:
        graphs = self._decode_graphs(max_batch, pages_per_seq, self.layer_ops)
        try:
            graphs.capture()
            return graphs
        except Exception:
            fallback = self._graph_fallback()
            if fallback is None:
                raise
            log.warning(
                "CUDA-graph capture with %s failed; capturing with %s", *fallback, exc_info=True
            )
        return self._capture_graphs(max_batch, pages_per_seq)

    def _graph_fallback(self) -> tuple[str, str] | None:
        """After a failed capture: switch one chosen (not requested) kernel to torch, the
        LoRA kernel first; (what failed, what replaces it), or None when nothing is left."""
        if self.lora is not None and self.lora.kernel != "torch" and self.lora.may_fall_back:
            failed = f"the {self.lora.kernel} LoRA kernel"
            self.lora.use_torch_kernel()
            return failed, "the torch LoRA kernel"
        if self.layer_ops is not TORCH_OPS and self.config.layer_ops == "auto":
            self.layer_ops = TORCH_OPS
            return "fused layer ops", "torch ops"
        return None

    @property
    def attention_backend(self) -> str:
        return self.backend.name

    def keep_sampled(self, token_ids: torch.Tensor, request_ids: Sequence[str]) -> None:
        """The ids sampled from the latest step's logits (on the device, row i for
        request_ids[i]): the next step's placeholder chunks take their tokens from here."""
        self._sampled = token_ids
        self._sampled_rows = {rid: i for i, rid in enumerate(request_ids)}

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits [batch.num_sampled, vocab] of the sampled chunks, in batch order
        (queued on the device; nothing here waits for it). With `all_logits` chunks, the
        rows of `batch.logit_rows()` instead (every token of those chunks)."""
        if not batch.chunks:
            return torch.empty((0, self.model.cfg.vocab_size), device=self.device)
        layout, fill, seq_slots = self._check(batch)
        if self.graphs is not None and batch.is_decode_only and not batch.has_all_logits:
            size = self.graphs.batch_size_for(layout)
            if size is not None:
                return self.graphs.run(layout, size, fill, seq_slots)
        step, lora = self._stage(layout, fill, seq_slots)
        hidden = self.model(
            step.input_ids, step.positions, self.backend.forward, self.layer_ops, lora
        )
        return self._logits(batch, layout, step, hidden)

    @torch.inference_mode()
    def execute_stage(self, batch: ScheduledBatch, carried: torch.Tensor | None) -> torch.Tensor:
        """A pipeline stage's part of `execute` (engine/core/pp_runner.py): `carried` is the
        stage before's output (None on stage 0, which embeds the tokens); returns the pair
        (h, residual) stacked [2, tokens, hidden] for the next stage, or on the last stage the
        logits `execute` returns. Raises ValueError for a malformed batch, as `execute`."""
        stage = self.model.pp_stage
        if stage is None or not batch.chunks:
            raise ValueError("execute_stage runs a pipeline stage's model on a non-empty batch")
        layout, fill, seq_slots = self._check(batch, tokens=stage.is_first)
        if self.graphs is not None and batch.is_decode_only and not batch.has_all_logits:
            size = self.graphs.batch_size_for(layout)
            if size is not None:  # (the stage's graph: `carried` in, the next pair out)
                return self.graphs.run(layout, size, fill, seq_slots, carried)
        step, lora = self._stage(layout, fill, seq_slots)
        out = self.model.forward_stage(
            step.input_ids, carried, step.positions, self.backend.forward, self.layer_ops, lora
        )
        return out if not stage.is_last else self._logits(batch, layout, step, out)

    def check(self, batch: ScheduledBatch) -> None:
        """Raise ValueError where `execute` would for a malformed batch (its bounds, its
        placeholders, its LoRA slots), running nothing (a pipeline's rank 0 before any
        rank starts the step)."""
        if batch.chunks:
            self._check(batch)

    def _check(
        self, batch: ScheduledBatch, tokens: bool = True
    ) -> tuple[BatchLayout, functools.partial[None] | None, np.ndarray | None]:
        """The batch's layout, placeholder fill and per-chunk LoRA slots, checked; `tokens`
        False: a later pipeline stage, which reads no token ids (no fill)."""
        layout = build_layout(batch, self.block_size)
        cfg = self.model.cfg
        check_bounds(
            layout, self.kv_cache.spec.num_blocks, cfg.vocab_size, cfg.max_position_embeddings
        )
        fill = self._placeholder_fill(batch, layout) if tokens else None
        return layout, fill, self._lora_slots(batch)

    def _stage(
        self,
        layout: BatchLayout,
        fill: functools.partial[None] | None,
        seq_slots: np.ndarray | None,
    ) -> tuple[StepInputs, LoraStep | None]:
        """The step's inputs on the device and the attention plan made (an eager step)."""
        lora = None
        if seq_slots is not None:
            assert self.lora is not None
            token_slots = np.repeat(seq_slots, np.diff(layout.qo_indptr))
            lora = eager_step(self.lora, token_slots, self.device)
        step = self._stager.stage(layout)
        if fill is not None:
            fill(step.input_ids)
        if self._planned is not None:  # flashinfer plans through a pinned buffer it reuses
            self._planned.synchronize()
        self.backend.prepare(step)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()
        return step, lora

    def _logits(
        self, batch: ScheduledBatch, layout: BatchLayout, step: StepInputs, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The logits `execute` returns, from the model's output `hidden` [T, hidden]."""
        if batch.num_sampled == 0 and not batch.has_all_logits:
            # Only mid-prompt chunks (a prompt longer than the step's token budget): the KV is
            # written, nothing is sampled. No head matmul, and no empty tensor for a kernel
            # (flashinfer's RMSNorm fails on zero rows with cudaErrorInvalidValue).
            return torch.empty((0, self.model.cfg.vocab_size), device=self.device)
        if batch.has_all_logits:
            hidden = hidden.index_select(0, to_device(batch.logit_rows(), torch.long, self.device))
        elif not layout.samples_every_row:
            hidden = hidden.index_select(0, step.sample_rows)
        return self.model.compute_logits(hidden, self.layer_ops)

    def _lora_slots(self, batch: ScheduledBatch) -> np.ndarray | None:
        """Each chunk's LoRA slot (int32), or None when no chunk reads one (the base path).
        Raises ValueError for a slot this runner does not have."""
        if not any(c.lora_slot >= 0 for c in batch.chunks):
            return None
        num_slots = 0 if self.lora is None else self.lora.num_slots
        slots = np.fromiter((c.lora_slot for c in batch.chunks), np.int32, len(batch.chunks))
        if int(slots.max()) >= num_slots:
            bad = next(c for c in batch.chunks if c.lora_slot >= num_slots)
            raise ValueError(
                f"request {bad.request_id}: LoRA slot {bad.lora_slot} out of range "
                f"(the runner has {num_slots} slots)"
            )
        return slots

    def _placeholder_fill(
        self, batch: ScheduledBatch, layout: BatchLayout
    ) -> functools.partial[None] | None:
        """What writes the placeholder chunks' tokens into the staged input ids (None: the
        batch has none). Raises ValueError if the latest kept sample lacks one of them."""
        rows: list[int] = []
        sources: list[int] = []
        for i, c in enumerate(batch.chunks):
            if not c.placeholder:
                continue
            source = self._sampled_rows.get(c.request_id)
            if c.num_tokens != 1 or source is None:
                raise ValueError(
                    f"request {c.request_id}: a placeholder chunk must be one token that the "
                    "latest kept sample holds"
                )
            rows.append(int(layout.qo_indptr[i]))
            sources.append(source)
        if not rows:
            return None
        assert self._sampled is not None
        return functools.partial(
            fill_placeholders, tokens=self._sampled, rows=rows, sources=sources
        )

    def clear_device_error(self) -> None:
        """After a failed step: a launch error (e.g. an invalid argument) stays pending in the
        CUDA runtime until the next launch check reads it, which would fail the next,
        healthy step's first kernel too. Read it here. A sticky error (illegal address) is not
        cleared by this: every later step fails and the worker must be replaced."""
        if self.device.type != "cuda":
            return
        for _ in range(2):
            try:
                torch.cuda.synchronize(self.device)
                torch.zeros(1, device=self.device).add_(1)
                return
            except RuntimeError:  # the pending error, now consumed
                continue

    def warmup(self, num_tokens: int = 256) -> None:
        """Run one prompt chunk over blocks 0.. (compiles kernels); call before serving."""
        bs = self.block_size
        num_tokens = min(num_tokens, self.kv_cache.spec.num_blocks * bs)
        blocks = tuple(range(cdiv(num_tokens, bs)))
        chunk = SeqChunk("warmup", (0,) * num_tokens, 0, blocks, sample=True)
        self.execute(ScheduledBatch((chunk,)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def fill_placeholders(
    input_ids: torch.Tensor, tokens: torch.Tensor, rows: list[int], sources: list[int]
) -> None:
    """input_ids[rows[i]] = tokens[sources[i]] on the device (a slice copy when both are runs,
    the steady decode case: the same requests in the same order)."""
    n = len(rows)
    r0, s0 = rows[0], sources[0]
    if rows == list(range(r0, r0 + n)) and sources == list(range(s0, s0 + n)):
        input_ids[r0 : r0 + n].copy_(tokens[s0 : s0 + n])
        return
    idx = to_device(rows + sources, torch.long, input_ids.device)
    input_ids.index_copy_(0, idx[:n], tokens.index_select(0, idx[n:]).to(input_ids.dtype))
