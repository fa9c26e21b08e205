"""The head- and layer-major KV pools: where their bytes are, and that attention sees what
block-major gives.

`KVCache.layer(i)` must be the same logical view for both layouts, so every consumer that
goes through it (KV writes, the torch backend) computes the same numbers; what differs is
only where a block's bytes sit, which the transfer side relies on (a head range of a block
is one region).
"""

from __future__ import annotations

import pytest
import torch
from runner_factories import BLOCK_SIZE, batch, chunk
from test_attention_torch import HKV, LAYERS, D, model_cfg

from engine.attention import build_layout, create_backend, stage_once
from engine.config import EngineConfig
from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVCache, KVCacheSpec
from engine.kv.kv_sizing import kv_layout


def spec(layout: str, num_blocks: int = 8, heads: int = HKV, dtype: str = "float32") -> KVCacheSpec:
    return KVCacheSpec(num_blocks, LAYERS, BLOCK_SIZE, heads, D, dtype, layout=layout)


def test_head_major_block_holds_each_head_as_one_region() -> None:
    s = spec(HEAD_MAJOR)
    assert s.shape == (8, HKV, LAYERS, 2, BLOCK_SIZE, D)
    assert spec(BLOCK_MAJOR).shape == (8, LAYERS, 2, BLOCK_SIZE, HKV, D)
    assert s.block_nbytes == spec(BLOCK_MAJOR).block_nbytes == LAYERS * 2 * BLOCK_SIZE * HKV * D * 4
    assert s.head_nbytes == s.block_nbytes // HKV
    cache = KVCache(s)
    view = cache.layer(1)
    assert view.shape == (8, 2, BLOCK_SIZE, HKV, D)
    view[5, 1, 3, 1] = 7.0  # block 5, V, token 3, head 1 of layer 1
    flat = cache.tensor.view(-1)
    per_block, per_head = s.block_nbytes // 4, s.head_nbytes // 4
    head1 = flat[5 * per_block + per_head : 5 * per_block + 2 * per_head]
    assert int((head1 == 7.0).sum()) == D and int((flat == 7.0).sum()) == D
    # within the head: layer 1, V (index 1), token 3
    at = ((1 * 2 + 1) * BLOCK_SIZE + 3) * D
    assert torch.equal(head1[at : at + D], torch.full((D,), 7.0))


def test_layer_major_keeps_each_layers_pages_together_and_a_block_in_segments() -> None:
    s = spec(LAYER_MAJOR)
    assert s.shape == (LAYERS, 8, 2, BLOCK_SIZE, HKV, D)
    assert s.block_nbytes == spec(BLOCK_MAJOR).block_nbytes
    assert (s.block_dim, s.num_segments) == (1, LAYERS)
    assert s.segment_nbytes * LAYERS == s.block_nbytes
    assert (spec(BLOCK_MAJOR).num_segments, spec(HEAD_MAJOR).block_dim) == (1, 0)
    cache = KVCache(s)
    view = cache.layer(1)
    assert view.shape == (8, 2, BLOCK_SIZE, HKV, D) and view.is_contiguous()
    view[5, 1, 3, 1] = 7.0  # block 5, V, token 3, head 1 of layer 1
    flat = cache.tensor.view(-1)
    seg = s.segment_nbytes // 4
    at = (1 * 8 + 5) * seg + ((1 * BLOCK_SIZE + 3) * HKV + 1) * D  # layer 1's segment of block 5
    assert torch.equal(flat[at : at + D], torch.full((D,), 7.0))
    assert int((flat == 7.0).sum()) == D


def test_copy_blocks_from_moves_every_layer_of_a_layer_major_block() -> None:
    torch.manual_seed(3)
    src, dst = KVCache(spec(LAYER_MAJOR)), KVCache(spec(LAYER_MAJOR, num_blocks=6))
    src.tensor.normal_()
    dst.copy_blocks_from(src, [7, 2], [0, 4])
    for layer in range(LAYERS):
        assert torch.equal(dst.layer(layer)[0], src.layer(layer)[7])
        assert torch.equal(dst.layer(layer)[4], src.layer(layer)[2])
        assert int(dst.layer(layer)[1:4].abs().sum()) == 0


def test_layer_views_of_both_layouts_hold_the_same_values_after_a_copy() -> None:
    torch.manual_seed(0)
    bm, hm = KVCache(spec(BLOCK_MAJOR)), KVCache(spec(HEAD_MAJOR))
    bm.tensor.normal_()
    for layer in range(LAYERS):
        hm.layer(layer).copy_(bm.layer(layer))
    for layer in range(LAYERS):
        assert torch.equal(hm.layer(layer), bm.layer(layer))
    # the same bytes, arranged head-first inside each block
    assert torch.equal(hm.tensor, bm.tensor.permute(0, 4, 1, 2, 3, 5))


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_write_kv_and_torch_attention_are_identical_on_both_layouts(dtype: str) -> None:
    """The same step on block-, head- and layer-major pools: bit-equal pools (per layer view)
    and bit-equal attention outputs (an e4m3 pool stores K / scale through the view)."""
    torch.manual_seed(1)
    scales = (0.05, 0.07) * LAYERS if dtype != "float32" else ()
    outs, caches = [], []
    for layout in (BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR):
        s = KVCacheSpec(32, LAYERS, BLOCK_SIZE, HKV, D, dtype, layout=layout, scales=scales)
        cache = KVCache(s)
        backend = create_backend("torch", model_cfg(), cache, compute_dtype=torch.float32)
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(27, n, D, generator=gen) for n in (4, HKV, HKV))
        steps = [batch(chunk("a", [0] * 20, 0, (9, 2)), chunk("b", [0] * 5, 0, (30,))),
                 batch(chunk("a", [0], 20, (9, 2)), chunk("b", [0], 5, (30,)))]  # fmt: skip
        got = []
        rows = 0
        for b in steps:
            step = stage_once(build_layout(b, BLOCK_SIZE))
            backend.prepare(step)
            n = sum(len(c.token_ids) for c in b.chunks)
            for layer in range(LAYERS):
                got.append(backend.forward(layer, q[rows : rows + n], k[rows : rows + n],
                                           v[rows : rows + n]))  # fmt: skip
            rows += n
        outs.append(got)
        caches.append(cache)
    for other in (1, 2):
        for a, b in zip(outs[0], outs[other], strict=True):
            assert torch.equal(a, b)
        for layer in range(LAYERS):
            assert torch.equal(caches[0].layer(layer).float(), caches[other].layer(layer).float())
        assert caches[other].tensor.float().abs().sum() > 0


def test_layout_choice_and_checks() -> None:
    assert kv_layout(EngineConfig(model_dir="m")) == BLOCK_MAJOR
    assert kv_layout(EngineConfig(model_dir="m"), torch.device("cpu")) == BLOCK_MAJOR
    assert kv_layout(EngineConfig(model_dir="m"), torch.device("cuda")) == LAYER_MAJOR
    pinned = EngineConfig(model_dir="m", kv_layout="block_major")
    assert kv_layout(pinned, torch.device("cuda")) == BLOCK_MAJOR
    assert kv_layout(EngineConfig(model_dir="m", kv_layout="head_major")) == HEAD_MAJOR
    assert kv_layout(EngineConfig(model_dir="m", kv_layout="layer_major")) == LAYER_MAJOR
    with pytest.raises(ValueError, match="kv_layout: one of auto, block_major, head_major, layer"):
        EngineConfig(model_dir="m", kv_layout="nhd")
    with pytest.raises(ValueError, match="KV layout 'x'"):
        spec("x")
    one = KVCache(spec(BLOCK_MAJOR))
    with pytest.raises(ValueError, match="incompatible KV caches"):
        KVCache(spec(HEAD_MAJOR)).copy_blocks_from(one, [0], [0])
    with pytest.raises(ValueError, match="incompatible KV caches"):
        KVCache(spec(LAYER_MAJOR)).copy_blocks_from(one, [0], [0])
