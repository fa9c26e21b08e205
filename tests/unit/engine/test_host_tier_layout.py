"""The host tier keeps the device pool's layout (engine/kv/host_tier.py): a layer-major pool's
host tier is [layers, host blocks, ...] too, every layer of a block goes out and comes back
(runs of adjacent blocks and scattered ones), and nothing else is written on either side. A
pipeline stage replaying rank 0's logged copies (engine/kv/host_mirror.py) holds its own
pool's part of the same blocks in the same slots. The copies go through a staging buffer
(engine/kv/block_mover.py): a layer of a chunk's run of host slots is one copy."""

from __future__ import annotations

import pytest
import torch

from engine.kv.block_mover import STAGING_BYTES, BlockMover, staging_blocks_for
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
    # scattered device blocks into one run of slots: one copy per segment (a layer-major
    # pool's layers; a block-first pool's block), not one per segment and block
    segments = LAYERS if layout == LAYER_MAJOR else 1
    assert sum(m.num_copies for m in tier._movers) == segments
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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Compared as bytes: exact for every element type (e4m3 NaNs included)."""
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_mover_copies_scattered_blocks_in_chunks_with_one_copy_per_layer_and_run(
    dtype: torch.dtype,
) -> None:
    """A layer-major pool's scattered blocks go out through a 4-block staging buffer: one
    copy per layer and run of adjacent host slots (not per layer and block), every byte
    exact (e4m3 too), and nothing else written on either side; and back the same way."""
    values = pool(LAYER_MAJOR).tensor
    device = (values.remainder(200) - 100).to(dtype)  # [layers, blocks, ...]
    host = torch.zeros_like(device[:, :HOST_BLOCKS])
    mover = BlockMover(device, host, block_dim=1, staging_blocks=4)
    pairs = [(13, 2), (1, 0), (7, 1), (9, 3), (3, 6), (15, 7)]  # slots 0-3 and 6-7: two runs
    mover.to_host(pairs)
    for b, slot in pairs:
        assert torch.equal(as_bytes(host[:, slot]), as_bytes(device[:, b]))
    assert not as_bytes(host[:, [4, 5]]).any()
    # chunks by slot: [0, 1, 2, 3] (one run) and [6, 7] (one run): a copy per layer each
    assert mover.num_copies == 2 * LAYERS
    back = torch.zeros_like(device)
    BlockMover(back, host, block_dim=1, staging_blocks=4).to_device(
        [(slot, b) for b, slot in pairs]
    )
    moved = [b for b, _ in pairs]
    assert torch.equal(as_bytes(back[:, moved]), as_bytes(device[:, moved]))
    assert not as_bytes(back[:, [b for b in range(BLOCKS) if b not in moved]]).any()


def test_a_staging_buffer_holds_what_fits_in_its_bytes_and_a_moves_largest_size() -> None:
    assert staging_blocks_for(2 << 20, 256) == STAGING_BYTES // (2 << 20) == 32
    assert staging_blocks_for(1024, 8) == 8
    assert staging_blocks_for(STAGING_BYTES * 2, 256) == 1
    with pytest.raises(ValueError, match="staging_blocks"):
        BlockMover(torch.zeros(4, 2), torch.zeros(2, 2), 0, 0)
