"""flashinfer's XQA decode (TensorRT-LLM's GQA decode kernel) over the pool's per-layer view.

Why: on Hopper with an e4m3 pool XQA runs its TMA + warpgroup-MMA FP8 kernel (q quantized to
e4m3, the scores' dot over e4m3 K as stored), built for exactly this case: a GQA group of query
heads per KV head, one token a sequence. The Triton split kernel (triton_decode.py) stays
further from its KV-read floor on the H200, bound by its work per tile (docs/benchmarks.md,
"Decode attention kernels").

XQA reads pages through a padded page table ([sequences, pages per sequence], int32) and the
sequence lengths, not flashinfer's CSR arrays: `page_table` builds both on the device from the
staged CSR arrays (a few small kernels a step, none a layer; fixed shapes, so a CUDA graph can
hold them). It reads K and V with the strides of the pool's view (`[blocks, 2, page, kv_heads,
dim]`, any layout). Its scales: one for q (k_scale / v_scale, folded into q before it is
rounded to e4m3) and one for K and V (v_scale); the product is the same attention.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.step import StepInputs

WORKSPACE_BYTES = 128 << 20
"""XQA's workspace: 8 MiB of semaphores (zeroed once, left zeroed by every launch), then the
multi-block partial results."""


XQA_PAGE_SIZES = (16, 32, 64, 128)
"""The page (block) sizes flashinfer 0.7.4's XQA builds for."""


def xqa_unavailable_reason(
    device: torch.device, page_size: int = 16, head_dim: int = 128
) -> str | None:
    """Why XQA cannot run here (None when it can): it needs CUDA on SM90+, a page size and
    head_dim it builds for, and flashinfer's XQA sources (the JIT builds it at first use)."""
    if page_size not in XQA_PAGE_SIZES:
        return f"XQA decode needs a block size in {XQA_PAGE_SIZES} (got {page_size})"
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"XQA decode needs head_dim a multiple of 16 in [16, 256] (got {head_dim})"
    if device.type != "cuda":
        return f"XQA decode runs on CUDA (got {device})"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10, 12):
        return f"XQA decode needs SM90, SM100 or SM120 (this GPU is SM{major}x)"
    try:
        from flashinfer.jit import env as jit_env

        if not (jit_env.FLASHINFER_CSRC_DIR / "xqa" / "mha.cu").exists():
            return "flashinfer's XQA sources (data/csrc/xqa) are not installed"
    except Exception as e:  # an optional dependency: any import failure means "not here"
        return f"flashinfer does not import: {e}"
    return None


def page_table(
    page_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Fill `table` ([n, width]) with each sequence's pages from the CSR arrays (sequence b:
    page_indices[kv_indptr[b]:kv_indptr[b+1]]; columns past its pages repeat its last page,
    never read as they lie past its length) and `seq_lens` ([n]) with its token count. On the
    device of the inputs, without syncing; every sequence holds at least one page."""
    n, width = table.shape
    starts = kv_indptr[:n].long()
    counts = kv_indptr[1 : n + 1].long() - starts
    cols = torch.arange(width, device=table.device)
    at = starts[:, None] + torch.minimum(cols[None, :], (counts - 1).clamp(min=0)[:, None])
    table.copy_(page_indices[at.clamp(max=max(page_indices.numel() - 1, 0))])
    seq_lens.copy_((counts - 1).clamp(min=0) * page_size + last_page_len[:n])


class XqaDecode:
    """XQA launches over one pool, with the workspace and (for CUDA graphs) the fixed page
    table and lengths buffers they read."""

    def __init__(self, device: torch.device, page_size: int) -> None:
        self.page_size = page_size
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._graph_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self._graph_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.table, self.seq_lens = self._graph_table, self._graph_lens
        """What the next `run` reads: the graph buffers, or an eager step's own tensors."""
        self._rows = 0

    def init_graphs(self, max_batch: int, pages_per_seq: int) -> None:
        """Fixed buffers for graph steps: a graph of batch B reads the first B rows, every
        column (its page count fixes XQA's longest sequence, so it never changes). Eager
        steps never write them."""
        dev = self.device
        self._graph_table = torch.zeros(max_batch, pages_per_seq, dtype=torch.int32, device=dev)
        self._graph_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.table, self.seq_lens = self._graph_table, self._graph_lens

    def stage(self, step: StepInputs, first: int, graph: bool) -> None:
        """The page table and lengths of the step's sequences from `first` on (its decodes):
        into the graph buffers, or fresh ones as wide as its longest page list."""
        assert step.kv_indptr is not None and step.kv_last_page_len is not None
        max_pages = int(np.diff(step.layout.kv_indptr[first:]).max())
        self.stage_pages(
            step.page_indices, step.kv_indptr[first:], step.kv_last_page_len[first:],
            max_pages, graph,
        )  # fmt: skip

    def stage_pages(
        self,
        page_indices: torch.Tensor,
        kv_indptr: torch.Tensor,
        last_page_len: torch.Tensor,
        max_pages: int,
        graph: bool,
    ) -> None:
        """`stage` from the CSR arrays on the device (`page_table`) and the longest page
        list's length (known on the host)."""
        rows = last_page_len.shape[0]
        if graph:
            self.table, self.seq_lens = self._graph_table, self._graph_lens
            if rows > self.table.shape[0] or max_pages > self.table.shape[1]:
                raise ValueError(f"{rows} sequences of {max_pages} pages exceed the graph buffers")
        else:
            self.table = torch.empty(rows, max(1, max_pages), dtype=torch.int32, device=self.device)
            self.seq_lens = torch.empty(rows, dtype=torch.int32, device=self.device)
        page_table(
            page_indices, kv_indptr, last_page_len, self.page_size, self.table[:rows],
            self.seq_lens[:rows],
        )  # fmt: skip
        self._rows = rows

    def run(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        sm_scale: float,
        k_scale: float,
        v_scale: float,
        out: torch.Tensor,
        out_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention of `q` ([rows, heads, dim], contiguous) over the staged pages of `pool`
        (`[blocks, 2, page, kv_heads, dim]`) into `out`, divided by `out_scale` (an e4m3
        `out`, o_proj's input: XQA writes it saturated; an e4m3 pool only)."""
        if q.shape[0] != self._rows:
            raise ValueError(f"q has {q.shape[0]} rows, the staged page table {self._rows}")
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        table = self.table[: self._rows]
        # the output's scale goes into bmm2_scale: flashinfer 0.7.4's o_scale is folded into
        # the K/V scale and divided out again for an e4m3 output, so it has no effect there
        return xqa_batch_decode_with_kv_cache(
            q, pool, self.workspace, table, self.seq_lens[: self._rows],
            table.shape[1] * self.page_size,
            bmm1_scale=sm_scale * k_scale, bmm2_scale=v_scale / out_scale, out=out,
            kv_layout="NHD",
        )  # fmt: skip
