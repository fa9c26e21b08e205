"""The page table XQA reads, built from the CSR arrays the engine stages (XQA itself runs on
the GPU: tests/gpu/test_fp8_fused_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.step import build_layout, stage_once
from engine.attention.xqa_decode import XqaDecode, page_table
from engine.batch import ScheduledBatch, SeqChunk


def test_page_table_lists_each_sequences_pages_and_its_length() -> None:
    chunks = (
        SeqChunk("a", (1,), 40, (7, 2, 9), True),  # 41 tokens: 3 pages, 9 in the last
        SeqChunk("b", (1,), 0, (4,), True),  # 1 token
        SeqChunk("c", (1,), 31, (5, 6), True),  # 32 tokens: 2 full pages
    )
    step = stage_once(build_layout(ScheduledBatch(chunks), 16))
    assert step.kv_indptr is not None and step.kv_last_page_len is not None
    table = torch.full((3, 5), -1, dtype=torch.int32)
    lens = torch.zeros(3, dtype=torch.int32)
    page_table(step.page_indices, step.kv_indptr, step.kv_last_page_len, 16, table, lens)
    # past a sequence's pages its last page repeats (never read: past its length)
    assert table.tolist() == [[7, 2, 9, 9, 9], [4, 4, 4, 4, 4], [5, 6, 6, 6, 6]]
    assert lens.tolist() == [41, 1, 32]


def test_page_table_of_the_decodes_after_a_prefill_reads_absolute_offsets() -> None:
    chunks = (
        SeqChunk("p", (1,) * 20, 0, (3, 8), True),  # a prefill first
        SeqChunk("d", (1,), 16, (1, 11), True),  # then a decode of 17 tokens
    )
    step = stage_once(build_layout(ScheduledBatch(chunks), 16))
    assert step.kv_indptr is not None and step.kv_last_page_len is not None
    table = torch.zeros((1, 2), dtype=torch.int32)
    lens = torch.zeros(1, dtype=torch.int32)
    page_table(step.page_indices, step.kv_indptr[1:], step.kv_last_page_len[1:], 16, table, lens)
    assert table.tolist() == [[1, 11]] and lens.tolist() == [17]


def test_an_eager_step_never_writes_the_buffers_a_graph_reads() -> None:
    """A captured graph reads the fixed page table and lengths; an eager (mixed) step between
    two graph steps stages into tensors of its own."""
    xqa = XqaDecode(torch.device("cpu"), 16)
    xqa.init_graphs(max_batch=4, pages_per_seq=3)
    graph_table, graph_lens = xqa.table, xqa.seq_lens
    decode = stage_once(build_layout(ScheduledBatch((SeqChunk("d", (1,), 16, (1, 11), True),)), 16))
    xqa.stage(decode, 0, graph=True)
    assert xqa.table.data_ptr() == graph_table.data_ptr()
    assert graph_table[0].tolist() == [1, 11, 11] and graph_lens[0].item() == 17

    mixed = stage_once(
        build_layout(
            ScheduledBatch(
                (SeqChunk("p", (1,) * 20, 0, (3, 8), True), SeqChunk("d", (1,), 17, (1, 11), True))
            ),
            16,
        )
    )
    xqa.stage(mixed, 1, graph=False)
    assert xqa.table.data_ptr() != graph_table.data_ptr()
    assert xqa.table.tolist() == [[1, 11]] and xqa.seq_lens.tolist() == [18]
    assert graph_table[0].tolist() == [1, 11, 11] and graph_lens[0].item() == 17

    xqa.stage(decode, 0, graph=True)
    assert xqa.table.data_ptr() == graph_table.data_ptr()
    longer = SeqChunk("d", (1,), 63, (1, 11, 12, 13), True)  # 4 pages: wider than the buffers
    with pytest.raises(ValueError, match="exceed the graph buffers"):
        xqa.stage(stage_once(build_layout(ScheduledBatch((longer,)), 16)), 0, graph=True)
