"""The flashinfer backend's metadata plumbing, on CPU, against a strict fake of flashinfer.

The fake implements the documented contract of the two wrappers the backend uses (argument
dtypes and lengths, NHD paged layout [pages, 2, page, Hkv, D], causal diagonal aligned to the
end of each sequence's KV, CUDA-graph mode reading its fixed buffers at run time) with plain
torch math. Real kernels are tested on the GPU (tests/gpu); this checks that the backend
splits batches, slices page lists and pads graph steps correctly wherever it runs.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from runner_factories import BLOCK_SIZE, batch, chunk, corpus_tokens, make_runner, prompt_tokens

from engine.attention import build_layout, stage_once
from engine.core.cuda_graphs import pad_decode_layout
from engine.loading.loaders import load_model
from engine.modeling.llama import LlamaModel


def _i32(t: torch.Tensor, name: str) -> list[int]:
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    return t.tolist()


def _attend(q, pool, qo, kv_indptr, indices, last, page) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Reference paged attention with flashinfer's bottom-right causal alignment."""
    hq, hkv = q.shape[1], pool.shape[3]
    out = torch.empty_like(q)
    for i in range(len(kv_indptr) - 1):
        pages = indices[kv_indptr[i] : kv_indptr[i + 1]]
        assert 1 <= last[i] <= page
        kv_len = (len(pages) - 1) * page + last[i]
        ctx = pool[torch.tensor(pages)]
        k = ctx[:, 0].reshape(-1, hkv, q.shape[2])[:kv_len].repeat_interleave(hq // hkv, 1)
        v = ctx[:, 1].reshape(-1, hkv, q.shape[2])[:kv_len].repeat_interleave(hq // hkv, 1)
        qi = q[qo[i] : qo[i + 1]]
        n = qi.shape[0]
        assert n <= kv_len, "a query row without its own KV"
        scores = torch.einsum("qhd,khd->hqk", qi, k) * q.shape[2] ** -0.5
        rows = torch.arange(n)[:, None] + (kv_len - n)
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > rows, float("-inf"))
        out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, layout: str, **kw: Any) -> None:
        assert layout == "NHD" and kw.get("backend") == "fa2"
        self.device = workspace.device
        self.graph = kw.get("use_cuda_graph", False)
        if self.graph:
            self.indptr_buf = kw["paged_kv_indptr_buffer"]
            self.indices_buf = kw["paged_kv_indices_buffer"]
            self.last_buf = kw["paged_kv_last_page_len_buffer"]
            assert len(self.indptr_buf) == len(self.last_buf) + 1

    def _plan(self, qo, indptr, indices, last, hq, hkv, d, page, **kw):  # type: ignore[no-untyped-def]
        assert indptr.device.type == "cpu" and last.device.type == "cpu"
        assert indices.device == self.device
        self.qo = _i32(qo, "qo_indptr")
        self.indptr, self.last = _i32(indptr, "kv_indptr"), _i32(last, "last_page_len")
        ind = _i32(indices, "indices")
        assert len(ind) == self.indptr[-1] and self.indptr[0] == 0
        self.dtype, self.page = kw["q_data_type"], page
        assert kw["kv_data_type"] == self.dtype and kw["sm_scale"] == d**-0.5
        if self.graph:  # graph mode: metadata lives in the fixed buffers
            assert len(self.last) == len(self.last_buf)
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last)
            self.indices_buf[: len(ind)].copy_(indices)
        else:
            self.indices = ind

    def run(self, q: torch.Tensor, pool: torch.Tensor, out: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        assert q.dtype == self.dtype == pool.dtype and q.is_contiguous()
        assert pool.dim() == 5 and pool.shape[1] == 2 and pool.shape[2] == self.page
        assert q.shape[0] == self.qo[-1]
        if self.graph:
            indptr, last = self.indptr_buf.tolist(), self.last_buf.tolist()
            indices = self.indices_buf[: indptr[-1]].tolist()
        else:
            indptr, last, indices = self.indptr, self.last, self.indices
        res = _attend(q, pool, self.qo, indptr, indices, last, self.page)
        if out is None:
            return res
        assert out.shape == q.shape and out.dtype == q.dtype
        out.copy_(res)
        return out


class _Prefill(_Wrapper):
    def plan(self, qo, indptr, indices, last, hq, hkv, d, page, causal=False, **kw):  # type: ignore[no-untyped-def]
        assert causal
        self._plan(qo, indptr, indices, last, hq, hkv, d, page, **kw)


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, page, **kw):  # type: ignore[no-untyped-def]
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last, hq, hkv, d, page, **kw)


@pytest.fixture()
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _Prefill  # type: ignore[attr-defined]
    fake.BatchDecodeWithPagedKVCacheWrapper = _Decode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    import engine.attention.flashinfer_backend as fb
    import engine.attention.registry as reg

    monkeypatch.setattr(reg, "flashinfer_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(fb, "flashinfer_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(fb, "WORKSPACE_BYTES", 1024)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


def test_flashinfer_backend_splits_and_plans_like_the_torch_reference(
    fake_flashinfer: None, model: LlamaModel, tiny_model_dir: Path
) -> None:
    corpus = corpus_tokens(tiny_model_dir)
    fi = make_runner(model, tiny_model_dir)
    fi = type(fi)(model, fi.kv_cache, replace(fi.config, attention_backend="flashinfer"))
    ref = make_runner(model, tiny_model_dir)
    assert fi.attention_backend == "flashinfer"
    toks = [prompt_tokens(corpus, i, 60) for i in range(4)]
    blocks = [(3, 9, 1, 30), (12, 5, 40, 41), (7, 8, 60, 2), (50, 51, 52, 20)]

    def c(i: int, s: int, e: int, sample: bool = True):  # type: ignore[no-untyped-def]
        return chunk(f"s{i}", toks[i][s:e], s, blocks[i], sample)

    steps = [
        batch(c(0, 0, 20, False), c(1, 0, 33), c(2, 0, 16), c(3, 0, 17)),  # prefill only
        batch(c(0, 20, 50), c(1, 33, 34), c(2, 16, 17), c(3, 17, 18)),  # prefill + decodes
        batch(c(1, 34, 35), c(0, 50, 59), c(2, 17, 18)),  # out of order: all prefill
        batch(c(0, 59, 60), c(1, 35, 36), c(2, 18, 19), c(3, 18, 19)),  # decodes only
    ]
    for b in steps:
        torch.testing.assert_close(fi.execute(b), ref.execute(b), rtol=1e-5, atol=1e-4)


def test_padded_graph_decode_step_matches_eager_and_writes_only_real_slots(
    fake_flashinfer: None, model: LlamaModel, tiny_model_dir: Path
) -> None:
    runner = make_runner(model, tiny_model_dir)
    fi = type(runner)(
        model, runner.kv_cache, replace(runner.config, attention_backend="flashinfer")
    )
    backend = fi.backend
    corpus = corpus_tokens(tiny_model_dir)
    prompts = [prompt_tokens(corpus, 20 + i, 20 + 5 * i) for i in range(3)]
    blocks = [(4, 6), (10, 11, 12), (33, 32)]
    fi.execute(batch(*(chunk(f"s{i}", p[:-1], 0, blocks[i]) for i, p in enumerate(prompts))))
    decode = batch(*(chunk(f"s{i}", p[-1:], len(p) - 1, blocks[i]) for i, p in enumerate(prompts)))
    layout = build_layout(decode, BLOCK_SIZE)
    before = fi.kv_cache.tensor.clone()
    eager = fi.execute(decode)
    after_eager = fi.kv_cache.tensor.clone()
    fi.kv_cache.tensor.copy_(before)

    backend.init_decode_graphs(max_batch=8, max_pages=64)
    padded, rows = pad_decode_layout(layout, 8)
    step = replace(stage_once(padded), write_rows=torch.from_numpy(rows))
    with torch.inference_mode():
        backend.prepare_decode_graph(step, 8)
        hidden = model(step.input_ids, step.positions, backend.forward)
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits[:3], eager, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fi.kv_cache.tensor, after_eager, rtol=1e-5, atol=1e-5)
    changed = (fi.kv_cache.tensor != before).flatten(4).any(-1).any(1).any(1)  # [block, slot]
    written = set(zip(layout.slot_blocks.tolist(), layout.slot_offsets.tolist(), strict=True))
    assert {tuple(x) for x in changed.nonzero().tolist()} == written
