"""Step layout, KV writes and paged attention of the torch backend vs dense attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runner_factories import BLOCK_SIZE, batch, chunk, scattered_blocks

from engine.attention import BackendUnavailable, build_layout, create_backend, stage_once
from engine.attention.registry import resolve_backend_name
from engine.core.cuda_graphs import graph_batch_sizes, pad_decode_layout
from engine.kv.kv_cache import KVCache, KVCacheSpec
from vocabulary.model_config import ModelConfig, RopeConfig

HQ, HKV, D, LAYERS = 4, 2, 32, 2


def model_cfg(num_heads: int = HQ, num_kv_heads: int = HKV) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=num_heads * D,
        intermediate_size=64,
        num_layers=LAYERS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=D,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope=RopeConfig(),
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=False,
        bos_token_id=None,
        eos_token_ids=(),
        torch_dtype="float32",
    )


def pool(num_blocks: int = 32, num_kv_heads: int = HKV) -> KVCache:
    spec = KVCacheSpec(num_blocks, LAYERS, BLOCK_SIZE, num_kv_heads, D, "float32")
    return KVCache(spec)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of a whole sequence in float64: q [L,Hq,D], k/v [L,Hkv,D]."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double()
    vd = vd.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) / D**0.5
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd).float()


def test_layout_flattens_chunks_with_slots_pages_and_prefill_split() -> None:
    b = batch(
        chunk("a", [1] * 20, 0, (7, 3), sample=False),
        chunk("b", [2] * 5, 14, (4, 9, 1)),
        chunk("c", [3], 32, (5, 6, 8)),
    )
    lay = build_layout(b, BLOCK_SIZE)
    assert lay.positions.tolist() == [*range(20), *range(14, 19), 32]
    assert lay.slot_blocks.tolist() == [7] * 16 + [3] * 4 + [4, 4, 9, 9, 9, 8]
    assert lay.slot_offsets.tolist() == [*range(16), 0, 1, 2, 3, 14, 15, 0, 1, 2, 0]
    assert lay.qo_indptr.tolist() == [0, 20, 25, 26]
    assert lay.kv_indptr.tolist() == [0, 2, 4, 7]
    assert lay.page_indices.tolist() == [7, 3, 4, 9, 5, 6, 8]
    assert lay.kv_last_page_len.tolist() == [4, 3, 1]
    assert lay.kv_lens.tolist() == [20, 19, 33]
    assert lay.sample_rows.tolist() == [24, 25]
    assert (lay.num_prefill_seqs, lay.num_prefill_tokens) == (2, 25)
    assert not lay.samples_every_row


def test_layout_out_of_order_batch_sends_every_sequence_to_prefill() -> None:
    b = batch(chunk("d", [1], 3, (0,)), chunk("p", [1, 2, 3], 0, (1,)))
    assert build_layout(b, BLOCK_SIZE).num_prefill_seqs == 2
    decodes = batch(chunk("d", [1], 3, (0,)), chunk("e", [1], 16, (1, 2)))
    lay = build_layout(decodes, BLOCK_SIZE)
    assert lay.num_prefill_seqs == 0 and lay.samples_every_row


def test_layout_rejects_a_block_table_shorter_than_the_chunk() -> None:
    with pytest.raises(ValueError, match="request r: block table has 1 blocks"):
        build_layout(batch(chunk("r", [1] * 17, 0, (0,))), BLOCK_SIZE)
    with pytest.raises(ValueError, match="request e: empty chunk"):
        build_layout(batch(chunk("e", [], 0, (0,))), BLOCK_SIZE)


def test_write_kv_fills_exactly_the_step_slots() -> None:
    cache = pool()
    backend = create_backend("torch", model_cfg(), cache)
    step = stage_once(build_layout(batch(chunk("a", [0] * 18, 0, (9, 2))), BLOCK_SIZE))
    k, v = torch.randn(18, HKV, D), torch.randn(18, HKV, D)
    backend.write_kv(1, step, k, v)
    t = cache.tensor
    assert torch.equal(t[9, 1, 0], k[:16]) and torch.equal(t[2, 1, 0, :2], k[16:])
    assert torch.equal(t[9, 1, 1], v[:16]) and torch.equal(t[2, 1, 1, :2], v[16:])
    t[9, 1] = 0
    t[2, 1, :, :2] = 0
    assert not t.any()  # nothing else was touched (other layers, blocks, slots)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_chunked_and_decoded_sequences_attend_like_dense_causal_attention(
    heads: tuple[int, int],
) -> None:
    """Three sequences advance together through mixed steps (prefill chunks + decodes)."""
    hq, hkv = heads
    torch.manual_seed(0)
    cache = pool(num_kv_heads=hkv)
    backend = create_backend("torch", model_cfg(hq, hkv), cache)
    lengths = {"a": 45, "b": 23, "c": 7}
    blocks_a = scattered_blocks(1, 45, 32)
    free = [b for b in range(31, -1, -1) if b not in blocks_a]
    blocks = {"a": blocks_a, "b": (free[0], free[1]), "c": (free[2],)}
    q = {s: torch.randn(n, hq, D) for s, n in lengths.items()}
    k = {s: torch.randn(n, hkv, D) for s, n in lengths.items()}
    v = {s: torch.randn(n, hkv, D) for s, n in lengths.items()}
    # (seq, start, end) per step: chunk boundaries straddle blocks; decodes come last
    steps = [
        [("a", 0, 10), ("c", 0, 5)],
        [("a", 10, 30), ("b", 0, 21), ("c", 5, 6)],
        [("a", 30, 44), ("b", 21, 22), ("c", 6, 7)],
        [("a", 44, 45), ("b", 22, 23)],
    ]
    got: dict[str, list[torch.Tensor]] = {s: [] for s in lengths}
    for step_chunks in steps:
        b = batch(*(chunk(s, [0] * (e - st), st, blocks[s]) for s, st, e in step_chunks))
        step = stage_once(build_layout(b, BLOCK_SIZE))
        backend.prepare(step)
        out = backend.forward(
            0,
            torch.cat([q[s][st:e] for s, st, e in step_chunks]),
            torch.cat([k[s][st:e] for s, st, e in step_chunks]),
            torch.cat([v[s][st:e] for s, st, e in step_chunks]),
        )
        rows = np.cumsum([0] + [e - st for _, st, e in step_chunks])
        for i, (s, _, _) in enumerate(step_chunks):
            got[s].append(out[rows[i] : rows[i + 1]])
    for s in lengths:
        torch.testing.assert_close(
            torch.cat(got[s]), dense_attention(q[s], k[s], v[s]), rtol=1e-5, atol=1e-5
        )


def test_auto_selects_torch_on_cpu_and_flashinfer_is_refused_there() -> None:
    cfg = model_cfg()
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cfg, cpu, torch.float32) == "torch"
    assert create_backend("auto", cfg, pool()).name == "torch"
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend_name("flashinfer", cfg, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("triton", cfg, cpu, torch.float32)


def test_graph_padding_repeats_row_zero_so_padding_rows_change_nothing() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    b = batch(chunk("x", [7], 20, (3, 8)), chunk("y", [9], 5, (6,), sample=False))
    padded, rows = pad_decode_layout(build_layout(b, BLOCK_SIZE), 4)
    assert padded.input_ids.tolist() == [7, 9, 0, 0]
    assert padded.positions.tolist() == [20, 5, 0, 0]
    assert padded.slot_blocks.tolist() == [8, 6, 8, 8]
    assert padded.slot_offsets.tolist() == [4, 5, 4, 4]
    assert rows.tolist() == [0, 1, 0, 0]
    assert padded.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert padded.page_indices.tolist() == [3, 8, 6, 3, 3]
    assert padded.kv_last_page_len.tolist() == [5, 6, 1, 1]
    assert padded.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert padded.sample_rows.tolist() == [0]
    assert padded.num_prefill_seqs == 0
