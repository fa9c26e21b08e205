"""One step's inputs: the host layout of a `ScheduledBatch` and its device copy.

`build_layout(batch, block_size)` turns the scheduler's batch into flat int32 host arrays
(token ids, positions, KV slots, per-sequence query/KV extents and page lists). `StepStager`
moves them to the device in one host→device copy (through a pinned buffer on CUDA) and returns
`StepInputs`: device views the model and the attention backends read during the step.

Conventions shared with flashinfer (and used by the torch backend too): sequence i owns query
rows [qo_indptr[i], qo_indptr[i+1]) of the flat token batch and KV pages
page_indices[kv_indptr[i] : kv_indptr[i+1]] (its block table cut to the pages its context
covers); its context is kv_len[i] = start_pos[i] + query_len[i] tokens, of which the last page
holds kv_last_page_len[i] (1..block_size). Token t is written to KV slot
(slot_blocks[t], slot_offsets[t]) = (block_ids[p // block_size], p % block_size) for its
position p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.batch import ScheduledBatch
from vocabulary.numeric import cdiv


def _frozen(values: list[int]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int32)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class BatchLayout:
    """Host-side (numpy int32, read-only) arrays of one step; see the module docstring."""

    block_size: int
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_blocks: np.ndarray  # [T]
    slot_offsets: np.ndarray  # [T]
    qo_indptr: np.ndarray  # [S + 1]
    kv_indptr: np.ndarray  # [S + 1]
    kv_last_page_len: np.ndarray  # [S]
    kv_lens: np.ndarray  # [S] context length after this step (cached + new)
    start_pos: np.ndarray  # [S]
    page_indices: np.ndarray  # [kv_indptr[-1]]
    sample_rows: np.ndarray  # [N] last row of each chunk with sample=True, in batch order
    num_prefill_seqs: int
    """Sequences [0, num_prefill_seqs) take the prefill (multi-token) attention path; the rest
    are single-token decodes. Equals the number of leading multi-token chunks when every later
    chunk has one token (the scheduler's order), else every sequence (all take prefill)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.page_indices.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(self.sample_rows.shape[0])

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.qo_indptr[self.num_prefill_seqs])

    @property
    def samples_every_row(self) -> bool:
        """Every token is sampled, in order (a decode-only step where every chunk samples)."""
        return self.num_sampled == self.num_tokens


def build_layout(batch: ScheduledBatch, block_size: int) -> BatchLayout:
    """Flatten a batch; raise ValueError naming the request if a chunk is malformed."""
    ids: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    qo_indptr = [0]
    kv_indptr = [0]
    last_page_len: list[int] = []
    kv_lens: list[int] = []
    starts: list[int] = []
    pages: list[int] = []
    sample_rows: list[int] = []
    bs = block_size
    for c in batch.chunks:
        n, start = len(c.token_ids), c.start_pos
        end = start + n
        if n == 0 or start < 0:
            raise ValueError(f"request {c.request_id}: empty chunk or negative start_pos")
        num_pages = cdiv(end, bs)
        if num_pages > len(c.block_ids):
            raise ValueError(
                f"request {c.request_id}: block table has {len(c.block_ids)} blocks "
                f"({len(c.block_ids) * bs} tokens) but the chunk ends at position {end}"
            )
        ids.extend(c.token_ids)
        positions.extend(range(start, end))
        if n == 1:
            slot_blocks.append(c.block_ids[start // bs])
            slot_offsets.append(start % bs)
        else:
            table = c.block_ids
            slot_blocks.extend([table[p // bs] for p in range(start, end)])
            slot_offsets.extend([p % bs for p in range(start, end)])
        qo_indptr.append(qo_indptr[-1] + n)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        last_page_len.append(end - (num_pages - 1) * bs)
        kv_lens.append(end)
        starts.append(start)
        pages.extend(c.block_ids[:num_pages])
        if c.sample:
            sample_rows.append(qo_indptr[-1] - 1)
    lens = [c.num_tokens for c in batch.chunks]
    lead = next((i for i, n in enumerate(lens) if n == 1), len(lens))
    num_prefill = lead if all(n == 1 for n in lens[lead:]) else len(lens)
    return BatchLayout(
        block_size=bs,
        input_ids=_frozen(ids),
        positions=_frozen(positions),
        slot_blocks=_frozen(slot_blocks),
        slot_offsets=_frozen(slot_offsets),
        qo_indptr=_frozen(qo_indptr),
        kv_indptr=_frozen(kv_indptr),
        kv_last_page_len=_frozen(last_page_len),
        kv_lens=_frozen(kv_lens),
        start_pos=_frozen(starts),
        page_indices=_frozen(pages),
        sample_rows=_frozen(sample_rows),
        num_prefill_seqs=num_prefill,
    )


def check_bounds(layout: BatchLayout, num_blocks: int, vocab_size: int, max_positions: int) -> None:
    """Raise ValueError if a block id, token id or position would index out of range (on a
    GPU that would be a device-side assert that ends the process, not an exception)."""
    for name, arr, limit in (
        ("block id", layout.page_indices, num_blocks),
        ("token id", layout.input_ids, vocab_size),
        ("position", layout.positions, max_positions),
    ):
        if arr.shape[0] and (int(arr.min()) < 0 or int(arr.max()) >= limit):
            raise ValueError(
                f"{name} out of range: [{int(arr.min())}, {int(arr.max())}] vs limit {limit}"
            )


@dataclass(frozen=True)
class StepInputs:
    """Device (int32) views of one step's layout; valid until the next step is staged."""

    layout: BatchLayout
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    sample_rows: torch.Tensor  # [N]
    page_indices: torch.Tensor  # [P]
    kv_indptr: torch.Tensor | None = None  # [S + 1]
    kv_last_page_len: torch.Tensor | None = None  # [S]
    write_rows: torch.Tensor | None = None
    """CUDA-graph steps only: row of k/v written to each token's slot. Padding rows repeat
    row 0 and its slot, so their (identical) writes never touch another sequence's KV."""


_FIELDS = (
    "input_ids",
    "positions",
    "slot_blocks",
    "slot_offsets",
    "sample_rows",
    "page_indices",
    "kv_indptr",
    "kv_last_page_len",
)


class StepStager:
    """Copies a layout to the device in one transfer, reusing its buffers across steps.

    On CUDA the host side is one pinned buffer and the copy is asynchronous; before the
    buffer is rewritten the previous copy is waited for (an event), so a step never races the
    transfer of the one before. On CPU the device views alias the host buffer.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=self.device)
        self._copied: torch.cuda.Event | None = None

    def _ensure(self, n: int) -> None:
        if n <= self._host.numel():
            return
        cap = max(1 << 16, 1 << (n - 1).bit_length())
        if self._copied is not None:
            self._copied.synchronize()
        self._host = torch.empty(cap, dtype=torch.int32, pin_memory=self._cuda)
        self._dev = torch.empty_like(self._host, device=self.device) if self._cuda else self._host

    def stage(self, layout: BatchLayout) -> StepInputs:
        arrays = [getattr(layout, f) for f in _FIELDS]
        total = sum(a.shape[0] for a in arrays)
        self._ensure(total)
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host.numpy()
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, arr in zip(_FIELDS, arrays, strict=True):
            n = arr.shape[0]
            host[offset : offset + n] = arr
            views[name] = self._dev[offset : offset + n]
            offset += n
        if self._cuda:
            self._dev[:total].copy_(self._host[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return StepInputs(layout=layout, **views)


def stage_once(layout: BatchLayout, device: torch.device | str = "cpu") -> StepInputs:
    """Device inputs of one layout with a throwaway stager (tests, tools)."""
    return StepStager(device).stage(layout)
