"""The host tier keeps the device pool's layout (engine/kv/host_tier.py): a layer-major pool's
host tier is [layers, host blocks, ...] too, every layer of a block goes out and comes back
(runs of adjacent blocks and scattered ones), and nothing else is written on either side. A
pipeline stage replaying rank 0's logged copies (engine/kv/host_mirror.py) holds its own
pool's part of the same blocks in the same slots."""

from __future__ import annotations

import pytest
import torch

from engine.kv.host_mirror import StageHostTier
from engine.kv.host_tier import HostCopy, HostTier
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


@pytest.mark.parametrize("layout", [BLOCK_MAJOR, LAYER_MAJOR])
def test_a_stage_replaying_rank_0s_copies_holds_its_pools_part_of_the_same_slots(
    layout: str,
) -> None:
    """Rank 0's tier, mirrored, logs what it copies; another stage (a pool of other values)
    replays the log on its own pool and host blocks: the same slots hold the same blocks."""
    rank0, stage = pool(layout), pool(layout)
    stage.tensor.mul_(-1)  # the other stage's layers: other values
    dim = stage.spec.block_dim
    tier = HostTier(HOST_BLOCKS, rank0.tensor, max_blocks_per_step=8, block_dim=dim)
    tier.mirror()
    mirror = StageHostTier(HOST_BLOCKS, stage.tensor, block_dim=dim)
    before = stage.tensor.movedim(dim, 0).clone()
    for b in (4, 5, 6, 11):
        tier.offer(b, h(b))
    assert not tier.on_device_evict(11, h(11))  # uncopied at eviction: dropped, not copied
    tier.flush()
    copies = tier.take_copies()
    assert copies == (HostCopy(True, ((4, 0), (5, 1), (6, 2))),) and tier.take_copies() == ()
    mirror.apply(copies)
    host = mirror.tensor.movedim(dim, 0)
    assert all(torch.equal(host[slot], before[b]) for b, slot in ((4, 0), (5, 1), (6, 2)))
    stage.tensor.zero_()
    tier.onboard([(0, 9), (2, 10)])
    mirror.apply(tier.take_copies())
    blocks = stage.tensor.movedim(dim, 0)
    assert torch.equal(blocks[9], before[4]) and torch.equal(blocks[10], before[6])
    assert (mirror.num_offloaded, mirror.num_onboarded) == (tier.num_offloaded, 2)
