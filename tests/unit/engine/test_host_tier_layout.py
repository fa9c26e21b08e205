"""The host tier keeps the device pool's layout (engine/kv/host_tier.py): a layer-major pool's
host tier is [layers, host blocks, ...] too, every layer of a block goes out and comes back
(runs of adjacent blocks and scattered ones), and nothing else is written on either side."""

from __future__ import annotations

import pytest
import torch

from engine.kv.host_tier import HostTier
from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVCache, KVCacheSpec
from vocabulary.block_hash import BlockHash

LAYERS, BLOCKS, HOST_BLOCKS = 3, 16, 8


def pool(layout: str) -> KVCache:
    """A CPU pool whose every (block, layer) holds values of its own."""
    cache = KVCache(KVCacheSpec(BLOCKS, LAYERS, 4, 2, 8, "float32", layout=layout))
    blocks = cache.tensor.movedim(cache.spec.block_dim, 0)  # [blocks, ...] whatever the layout
    blocks.copy_(torch.arange(blocks.numel(), dtype=torch.float32).view(blocks.shape))
    return cache


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


@pytest.mark.parametrize("layout", [BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR])
def test_offload_and_onboard_move_every_layer_of_each_block_in_the_pools_layout(
    layout: str,
) -> None:
    cache = pool(layout)
    spec, dim = cache.spec, cache.spec.block_dim
    before = cache.tensor.movedim(dim, 0).clone()  # [blocks, ...]: block b's every layer
    tier = HostTier(HOST_BLOCKS, cache.tensor, max_blocks_per_step=8, block_dim=dim)
    shape = list(spec.shape)
    shape[dim] = HOST_BLOCKS
    assert list(tier.tensor.shape) == shape and tier.block_nbytes == spec.block_nbytes
    offered = [4, 5, 6, 11, 2]  # a run of three, then two scattered blocks
    for b in offered:
        tier.offer(b, h(b))
    tier.flush()
    host = tier.tensor.movedim(dim, 0)
    slots = [tier.lookup(h(b)) for b in offered]
    assert slots == [0, 1, 2, 3, 4]
    for b, slot in zip(offered, slots, strict=True):
        assert torch.equal(host[slot], before[b])
    assert not host[len(offered) :].any()  # the free slots were not written
    cache.tensor.zero_()  # the device pool reuses every block
    back = {9: 4, 10: 5, 11: 6, 0: 2, 13: 11}  # device block <- the block its slot holds
    tier.onboard([(slots[offered.index(src)], dst) for dst, src in back.items()])  # type: ignore[misc]
    blocks = cache.tensor.movedim(dim, 0)
    for dst, src in back.items():
        assert torch.equal(blocks[dst], before[src])
        for layer in range(LAYERS):  # what attention reads: each layer's page of the block
            assert torch.equal(cache.layer(layer)[dst], pool(layout).layer(layer)[src])
    assert not blocks[[b for b in range(BLOCKS) if b not in back]].any()
