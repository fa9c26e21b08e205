"""Blocks between a device pool and host blocks of the same layout, in few copies.

The host tier (engine/kv/host_tier.py) moves blocks between a device pool and host slots.
A block of a layer-major pool (the default on a GPU) is one piece per layer, and the blocks
of one move are scattered over the pool, so copying them piece by piece is `num_layers`
copies a block: ~4,900 `cudaMemcpyAsync` of 64 KiB a step for Llama-3-8B when finishing
requests give back their blocks, ~2.5 µs of host time each on the engine's thread before the
step is launched, and the step waiting on the device for the ones it fences on
(docs/benchmarks.md, "Slow engine steps").

`BlockMover` gathers a move's blocks on the device into a staging buffer first (one
`index_select` kernel over every segment), so the device side of each copy is contiguous,
and orders them by host slot, so a run of adjacent slots is one copy per segment: the copies
of a chunk of blocks are `segments x runs of slots` (`segments` for the usual run of fresh
slots) instead of `segments x blocks`. The way back (onboard) is the mirror image: one copy
per segment and run of slots into the staging buffer, then one `index_copy_` scatters the
chunk into its device blocks.

The staging buffer holds `staging_blocks` blocks (`staging_blocks_for`: at most
`STAGING_BYTES`), on the pool's device, and a move of more blocks goes through it in chunks.
Everything is queued on the current stream, so a chunk's gather never overwrites a staging
buffer an earlier copy on that stream still reads. The host tier has one mover for its side
stream and one for the steps' streams; a split engine's two loops step on two streams, so a
move queued on another stream than the mover's last one first waits (on the device) for that
last move. Bytes are moved as bytes (uint8 views), whatever the pool's element type (e4m3
too). On CPU the same steps run synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.kv_cache import block_segments

STAGING_BYTES = 64 << 20
"""At most this much device memory per staging buffer (the host tier has two)."""


def staging_blocks_for(block_nbytes: int, max_blocks: int) -> int:
    """Blocks a staging buffer holds: `max_blocks` (a move's largest size) or as many as fit
    in `STAGING_BYTES`, whichever is less, and at least one."""
    return max(1, min(max_blocks, STAGING_BYTES // max(1, block_nbytes)))


def stream_movers(
    device_kv: torch.Tensor, host: torch.Tensor, block_dim: int, max_blocks: int
) -> tuple[BlockMover, BlockMover]:
    """A host tier's two movers between `device_kv` and `host` (module docstring): the step
    stream's (onboards, copies at eviction) and the side stream's (offloads), each with its
    own staging buffer of `staging_blocks_for` a move of at most `max_blocks` blocks."""
    block_nbytes = host.numel() // host.shape[block_dim] * host.element_size()
    staging = staging_blocks_for(block_nbytes, max_blocks)
    step = BlockMover(device_kv, host, block_dim, staging)
    return step, BlockMover(device_kv, host, block_dim, staging)


class BlockMover:
    """Copies blocks between a device pool and host blocks in the pool's layout through a
    staging buffer on the pool's device (module docstring)."""

    def __init__(
        self, device_kv: torch.Tensor, host: torch.Tensor, block_dim: int, staging_blocks: int
    ) -> None:
        """`device_kv` and `host`: contiguous tensors of one layout whose block ids index
        `block_dim`; `staging_blocks`: the staging buffer's size in blocks."""
        if staging_blocks <= 0:
            raise ValueError(f"staging_blocks must be positive, got {staging_blocks}")
        self._device = block_segments(device_kv, block_dim).view(torch.uint8)  # [S, B, bytes]
        self._host = block_segments(host, block_dim).view(torch.uint8)
        segments, _, nbytes = self._device.shape
        self.staging_blocks = staging_blocks
        self._staging = torch.empty(
            segments * staging_blocks * nbytes, dtype=torch.uint8, device=device_kv.device
        )
        self.num_copies = 0
        """Host <-> device copies queued so far (the figure this module exists to keep low)."""
        self._last: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None
        """The stream of the latest move and an event after it (CUDA only)."""

    def to_host(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device block `b` into host slot `s` for `(b, s)` pairs, queued on the current
        stream."""
        self._after_last_move()
        for chunk in self._chunks(pairs, slot_at=1):
            stage = self._stage(len(chunk))
            blocks = self._index([b for b, _ in chunk])
            torch.index_select(self._device, 1, blocks, out=stage)
            for i, slot, n in _slot_runs([s for _, s in chunk]):
                for host, staged in zip(self._host, stage, strict=True):
                    host[slot : slot + n].copy_(staged[i : i + n], non_blocking=True)
                self.num_copies += len(stage)
        self._mark_move()

    def to_device(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host slot `s` into device block `b` for `(s, b)` pairs, queued on the current
        stream."""
        self._after_last_move()
        for chunk in self._chunks(pairs, slot_at=0):
            stage = self._stage(len(chunk))
            for i, slot, n in _slot_runs([s for s, _ in chunk]):
                for host, staged in zip(self._host, stage, strict=True):
                    staged[i : i + n].copy_(host[slot : slot + n], non_blocking=True)
                self.num_copies += len(stage)
            self._device.index_copy_(1, self._index([b for _, b in chunk]), stage)
        self._mark_move()

    def _after_last_move(self) -> None:
        """Make the current stream wait for the latest move when that was queued on another
        stream (its copies may still read or write the staging buffer)."""
        if self._last is None:
            return
        stream, done = self._last
        current = torch.cuda.current_stream(self._device.device)
        if current != stream:
            current.wait_event(done)

    def _mark_move(self) -> None:
        if self._device.device.type == "cuda":
            stream = torch.cuda.current_stream(self._device.device)
            done = torch.cuda.Event()
            done.record(stream)
            self._last = (stream, done)

    def _chunks(
        self, pairs: Sequence[tuple[int, int]], slot_at: int
    ) -> list[Sequence[tuple[int, int]]]:
        """The pairs ordered by host slot (adjacent slots make one copy), in chunks that fit
        the staging buffer."""
        ordered = sorted(pairs, key=lambda pair: pair[slot_at])
        k = self.staging_blocks
        return [ordered[i : i + k] for i in range(0, len(ordered), k)]

    def _stage(self, n: int) -> torch.Tensor:
        """The staging buffer's first `n` blocks as a contiguous [segments, n, bytes]."""
        segments, _, nbytes = self._device.shape
        return self._staging[: segments * n * nbytes].view(segments, n, nbytes)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """Block ids as an index on the pool's device. On a GPU the ids go through pinned
        memory: a copy from pageable memory may make the driver wait for the stream first
        (the side stream waits for the running step: the engine's thread would too), and
        torch's pinned-memory cache keeps the block until the copy has read it."""
        index = torch.tensor(ids, dtype=torch.long)
        if self._device.device.type != "cuda":
            return index
        return index.pin_memory().to(self._device.device, non_blocking=True)


def _slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Ascending host slots as runs `(first position, first slot, length)` of adjacent slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
