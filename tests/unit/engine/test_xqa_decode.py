"""The page table XQA reads, built from the CSR arrays the engine stages (XQA itself runs on
the GPU: tests/gpu/test_fp8_fused_gpu.py)."""

from __future__ import annotations

import torch

from engine.attention.step import build_layout, stage_once
from engine.attention.xqa_decode import page_table
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
