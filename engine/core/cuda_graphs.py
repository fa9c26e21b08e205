"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode-only step of n sequences replays the graph captured for the smallest size B >= n of
(1, 2, 4, ..., max_batch). A graph reads its inputs from one fixed int32 device region

    ids | positions | slot blocks | slot offsets | write rows | sample rows | pages

(each of the first six `max_batch` long), filled per step by one host→device copy from a
pinned mirror; placeholder ids (overlap scheduling) are then overwritten on the device
(`run`'s `fill`) before the replay. Padding rows decode token 0 at position 0 over sequence
0's first page and write row 0's own k/v to row 0's slot (`StepInputs.write_rows`), so they
change nothing that a real row does not. Before each replay the attention backend re-plans
its graph-mode decode wrapper of size B (outside the graph, in place). Nothing here waits for
the device, but the mirror and the plan's pinned buffers are rewritten only once the previous
step's copies out of them have run (an event recorded after each plan).

With LoRA weights (engine/lora/lora_apply.py) every size is captured twice: the base graph, as
above, and a LoRA graph whose region has a seventh row field, each row's LoRA slot (-1: base;
padding rows -1), read by the graph's LoRA kernel. `run` replays the base graph when no row
reads a slot, so a step without adapters costs what it did without LoRA.

A pipeline stage's model (`LlamaModel.pp_stage`, engine/core/pp_runner.py) is captured the
same way over its own layers (`LlamaModel.forward_stage`): a stage after the first reads the
stage before's pair (h, residual) from a fixed input buffer [2, max_batch, hidden], which `run`
fills from what the stage received (`carried`), and a stage before the last returns its pair
[2, n, hidden] (a copy: the graph's output buffer is rewritten by the next replay while the
send may still read it); the last stage returns logits as a whole model does. The sends and
receives between stages stay outside the graphs. Padding rows of the input buffer hold an
earlier step's rows: their outputs are dropped, and their k/v writes are row 0's (above).

Invariant: capture runs the model eagerly once per size to warm up, which writes into slot 0
of block 0; capture before any sequence holds KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from engine.attention.base import AttentionBackend
from engine.attention.step import BatchLayout, StepInputs, build_layout
from engine.batch import ScheduledBatch, SeqChunk
from engine.lora.lora_apply import LoraWeights, graph_step
from engine.modeling.layer_ops import TORCH_OPS, LayerOps
from engine.modeling.llama import LlamaModel

_NUM_ROW_FIELDS = 6  # ids, positions, slot blocks, slot offsets, write rows, sample rows
_LORA_FIELD = 6  # with LoRA: each row's LoRA slot, after the six above


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch (max_batch itself included)."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


def pad_decode_layout(layout: BatchLayout, batch_size: int) -> tuple[BatchLayout, np.ndarray]:
    """The layout padded to batch_size single-token sequences, and the write row of each."""
    n, pad = layout.num_seqs, batch_size - layout.num_seqs

    def cat(a: np.ndarray, fill: int | np.ndarray) -> np.ndarray:
        out = np.concatenate([a, np.broadcast_to(np.asarray(fill, dtype=np.int32), (pad,))])
        out.flags.writeable = False
        return out

    last_page = int(layout.kv_indptr[-1])
    padded = replace(
        layout,
        input_ids=cat(layout.input_ids, 0),
        positions=cat(layout.positions, 0),
        slot_blocks=cat(layout.slot_blocks, layout.slot_blocks[0]),
        slot_offsets=cat(layout.slot_offsets, layout.slot_offsets[0]),
        qo_indptr=np.arange(batch_size + 1, dtype=np.int32),
        kv_indptr=cat(layout.kv_indptr, np.arange(last_page + 1, last_page + pad + 1)),
        kv_last_page_len=cat(layout.kv_last_page_len, 1),
        kv_lens=cat(layout.kv_lens, 1),
        start_pos=cat(layout.start_pos, 0),
        page_indices=cat(layout.page_indices, layout.page_indices[0]),
        num_prefill_seqs=0,
    )
    rows = np.concatenate([np.arange(n), np.zeros(pad, dtype=np.int64)]).astype(np.int32)
    return padded, rows


class DecodeGraphs:
    """Captured decode steps of a model + attention backend + layer ops (see the module
    docstring)."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        max_batch: int,
        max_pages_per_seq: int,
        ops: LayerOps = TORCH_OPS,
        lora: LoraWeights | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.ops = ops
        self.lora = lora
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_pages = self.max_batch * max_pages_per_seq
        device = backend.kv_cache.device
        self._num_fields = _NUM_ROW_FIELDS + (lora is not None)
        # row fields, then each sequence's last page length and KV indptr, then the pages
        region = (self._num_fields + 2) * self.max_batch + 1 + self.max_pages
        self._dev = torch.zeros(region, dtype=torch.int32, device=device)
        self._host = torch.zeros(region, dtype=torch.int32, pin_memory=True)
        self._copied: torch.cuda.Event | None = None
        self._sets: dict[int, _GraphSet] = {}
        """One set of graphs per stream they were captured on (a split engine captures one
        per decode partition), keyed by the stream's handle."""
        self._first: _GraphSet | None = None
        self._pool = torch.cuda.graph_pool_handle()
        stage = model.pp_stage
        self._carried: torch.Tensor | None = None
        """A pipeline stage after the first: the graphs' input pair (module docstring)."""
        if stage is not None and not stage.is_first:
            shape = (2, self.max_batch, model.cfg.hidden_size)
            self._carried = torch.zeros(shape, dtype=model.dtype, device=device)
        self._passes_on = stage is not None and not stage.is_last
        """The graphs' outputs are the pair for the next stage, not logits."""
        self.num_replays = 0
        backend.init_decode_graphs(self.max_batch, self.max_pages)
        self.rope_in_attention = backend.graph_rope(model.rotary)
        """The backend rotates q/k inside its graph decode (the model skips its RoPE op)."""

    def batch_size_for(self, layout: BatchLayout) -> int | None:
        """The captured size a decode-only layout replays at, or None (run it eagerly)."""
        n = layout.num_seqs
        if layout.num_tokens != n or n > self.max_batch:
            return None
        size = next(s for s in self.sizes if s >= n)
        if layout.num_pages + (size - n) > self.max_pages or size not in self._set().graphs:
            return None
        return size

    @property
    def num_sets(self) -> int:
        """How many streams (SM partitions) these graphs were captured on."""
        return len(self._sets)

    def captured_here(self) -> bool:
        """A set was captured on the current stream (`capture` there would add none)."""
        return torch.cuda.current_stream().cuda_stream in self._sets

    def _set(self) -> _GraphSet:
        """The graphs captured on the current stream; where none were, the first captured
        (a graph runs on the SMs of the stream it was captured on, whatever replays it)."""
        found = self._sets.get(torch.cuda.current_stream().cuda_stream, self._first)
        if found is None:
            raise RuntimeError("DecodeGraphs: capture() has not run")
        return found

    def _stage(
        self, layout: BatchLayout, size: int, lora_slots: np.ndarray | None = None
    ) -> StepInputs:
        """Stage a decode layout padded to `size`; with `lora_slots` (one per sequence) also
        the LoRA field (padding rows -1)."""
        padded, rows = pad_decode_layout(layout, size)
        m = self.max_batch
        fields: tuple[np.ndarray, ...] = (
            padded.input_ids,
            padded.positions,
            padded.slot_blocks,
            padded.slot_offsets,
            rows,
            padded.sample_rows,
        )
        if lora_slots is not None:
            pad = np.full(size - lora_slots.shape[0], -1, dtype=np.int32)
            fields = (*fields, np.concatenate([lora_slots, pad]))
        if self._copied is not None:  # the previous step's copies out of the pinned buffers
            self._copied.synchronize()
        host = self._host.numpy()
        for i, arr in enumerate(fields):
            host[i * m : i * m + arr.shape[0]] = arr
        lens_at = self._num_fields * m
        indptr_at = lens_at + m
        host[lens_at : lens_at + size] = padded.kv_last_page_len
        host[indptr_at : indptr_at + size + 1] = padded.kv_indptr
        base, num_pages = indptr_at + m + 1, padded.num_pages
        host[base : base + num_pages] = padded.page_indices
        used = base + num_pages
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        d = self._dev
        return StepInputs(
            kv_last_page_len=d[lens_at : lens_at + size],
            kv_indptr=d[indptr_at : indptr_at + size + 1],
            layout=padded,
            input_ids=d[0:size],
            positions=d[m : m + size],
            slot_blocks=d[2 * m : 2 * m + size],
            slot_offsets=d[3 * m : 3 * m + size],
            write_rows=d[4 * m : 4 * m + size],
            sample_rows=d[5 * m : 5 * m + padded.num_sampled],
            page_indices=d[base : base + num_pages],
        )

    def _plan(self, step: StepInputs, size: int) -> None:
        """The backend's plan of a staged step, then the event `_stage` waits for."""
        self.backend.prepare_decode_graph(step, size)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _lora_slots(self, size: int) -> torch.Tensor:
        """The LoRA field of a staged step of `size` rows (device int32)."""
        m = self.max_batch
        return self._dev[_LORA_FIELD * m : _LORA_FIELD * m + size]

    def _body(self, step: StepInputs, with_lora: bool = False) -> torch.Tensor:
        lora = None
        if with_lora:
            assert self.lora is not None
            lora = graph_step(self.lora, self._lora_slots(step.input_ids.shape[0]))
        if self.model.pp_stage is None:
            hidden = self.model(
                step.input_ids, step.positions, self.backend.forward, self.ops, lora,
                rope_in_attention=self.rope_in_attention,
            )  # fmt: skip
        else:
            size = step.input_ids.shape[0]
            carried = None if self._carried is None else self._carried[:, :size]
            hidden = self.model.forward_stage(
                step.input_ids, carried, step.positions, self.backend.forward, self.ops, lora,
                rope_in_attention=self.rope_in_attention,
            )  # fmt: skip
            if self._passes_on:
                return hidden
        return self.model.compute_logits(hidden, self.ops)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool shared by every size and
        set (only one step replays at a time; with LoRA weights, each size's LoRA graph too).
        Captured on the current stream when that is not the default one, as the set `run`
        replays on that stream: a graph runs on the SMs of the stream it was captured on,
        whatever stream replays it, so a split engine captures one set inside each decode
        partition it may move to (docs/benchmarks.md, "Split worker")."""
        current = torch.cuda.current_stream()
        capture_stream = None if current == torch.cuda.default_stream() else current
        captured = _GraphSet()  # registered once every size is in (a failed capture adds none)
        warm = ScheduledBatch(
            (SeqChunk("cuda-graph-warmup", (0,), start_pos=0, block_ids=(0,), sample=True),)
        )
        layout = build_layout(warm, self.backend.block_size)
        no_adapter = None if self.lora is None else np.full(1, -1, dtype=np.int32)
        pool = self._pool
        variants = (False, True) if self.lora is not None else (False,)
        for size in reversed(self.sizes):
            for with_lora in variants:
                step = self._stage(layout, size, no_adapter)
                self._plan(step, size)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._body(step, with_lora)  # JIT, lazy buffers: never inside a capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    logits = self._body(step, with_lora)
                graphs, outputs = captured.variant(with_lora)
                graphs[size], outputs[size] = graph, logits
        torch.cuda.synchronize()
        self._sets[current.cuda_stream] = captured
        if self._first is None:
            self._first = captured

    def _variant(
        self, with_lora: bool
    ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
        return self._set().variant(with_lora)

    def replay(self, size: int, with_lora: bool = False) -> None:
        """Replay graph `size` (the LoRA one with `with_lora`) on the inputs staged last
        (`run`; alone: a benchmark's pure device time of a decode step)."""
        self._variant(with_lora)[0][size].replay()
        self.num_replays += 1

    def run(
        self,
        layout: BatchLayout,
        size: int,
        fill: Callable[[torch.Tensor], None] | None = None,
        lora_slots: np.ndarray | None = None,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 logits of the sampled rows of a decode-only layout (replays graph `size`;
        queued, no host sync). `fill` writes placeholder ids into the staged input ids;
        `lora_slots` (one per sequence, -1 for base; None: every row is base) picks the
        LoRA graph. A pipeline stage (module docstring): `carried` is the stage before's
        pair [2, n, hidden] (None on stage 0); a stage before the last returns its pair."""
        with_lora = lora_slots is not None
        if with_lora and self.lora is None:
            raise ValueError("LoRA slots for decode graphs captured without LoRA weights")
        if (carried is None) != (self._carried is None):
            raise ValueError("decode graphs: the stage before's pair is for a later stage only")
        step = self._stage(layout, size, lora_slots)
        if fill is not None:
            fill(step.input_ids)
        if self._carried is not None and carried is not None:
            self._carried[:, : layout.num_seqs].copy_(carried)
        self._plan(step, size)
        self.replay(size, with_lora)
        logits = self._variant(with_lora)[1][size]
        if self._passes_on:
            return logits[:, : layout.num_seqs].clone()
        if layout.samples_every_row:
            return logits[: layout.num_seqs].clone()
        return logits.index_select(0, step.sample_rows)


class _GraphSet:
    """The graphs of every size captured on one stream, and their output logits."""

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_logits: dict[int, torch.Tensor] = {}

    def variant(
        self, with_lora: bool
    ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
        if with_lora:
            return self.lora_graphs, self.lora_logits
        return self.graphs, self.logits
