"""The small contract every transfer backend implements (NIXL; a loopback one in tests only).

A backend is owned by exactly one thread (the endpoint's `AgentLoop`): it is created, called
and closed there, so it needs no locks. It moves whole blocks of the registered KV pool by
READ (decode pulls) and carries short notifications between agents.

Poll states of one started read (`XferStatus`):

    IN_PROGRESS ──► DONE      (bytes landed; the backend also delivered the completion notice)
         └────────► FAILED    (poll raised or reported an error)

`abort` ends a read that is still in progress; it returns True only when the backend promises
not to write into the destination blocks any more (then they may be reused).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kv_transfer.types import TransferPlan
from vocabulary.kv_events import KVTier

if TYPE_CHECKING:
    import torch

    from engine.kv.kv_cache import KVCache
    from kv_transfer.config import KVTransferConfig


class XferStatus(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class MemoryRegion:
    """A registered KV region of an agent: `num_blocks` blocks of `block_nbytes` from `base`.

    This is the compact form of the agent's descriptor list. A block is `num_segments`
    contiguous pieces of `segment_nbytes`, `segment_stride` bytes apart: segment `s` of block
    `b` is the descriptor `(base_address + s * segment_stride + b * segment_nbytes,
    segment_nbytes, device_id)` of memory type `mem_type`. A block-first pool (block- or
    head-major, engine/kv/kv_cache.py) has one segment, so block `b` is one descriptor at
    `base_address + b * block_nbytes`; a layer-major one has a segment per layer, the
    layer's whole page array (`num_blocks * segment_nbytes`) apart.
    `tier` says which of the worker's tiers it is: its KV pool (DEVICE), or its host tier
    (HOST: pinned host memory the decode side reads directly; a DISK region would be a NIXL
    POSIX/GDS file region, not built).
    """

    mem_type: str  # "DRAM" (host) or "VRAM" (GPU)
    device_id: int  # CUDA device index for VRAM, 0 for DRAM
    base_address: int
    block_nbytes: int
    num_blocks: int
    tier: KVTier = KVTier.DEVICE
    num_segments: int = 1
    segment_stride: int = 0
    """Bytes from one segment of a block to its next (0 with one segment)."""

    def __post_init__(self) -> None:
        if self.num_segments < 1 or self.block_nbytes % self.num_segments:
            raise ValueError(
                f"a block of {self.block_nbytes} bytes in {self.num_segments} segments"
            )

    @property
    def segment_nbytes(self) -> int:
        """Bytes of one contiguous piece of a block (the whole block with one segment)."""
        return self.block_nbytes // self.num_segments


def kv_region(tensor: torch.Tensor, block_dim: int, tier: KVTier = KVTier.DEVICE) -> MemoryRegion:
    """The region of a KV tensor (a pool, or a tier's tensor in the pool's layout) whose block
    ids index dimension `block_dim` (`KVCacheSpec.block_dim`): the dimensions before it number
    a block's segments, those after it are one segment."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"a KV region must be one contiguous tensor, got strides {tensor.stride()}"
        )
    from engine.kv.kv_cache import (
        block_segments,  # imports torch: router-facing modules import this
    )

    num_segments, num_blocks, segment_elements = block_segments(tensor, block_dim).shape
    segment_nbytes = segment_elements * tensor.element_size()
    return MemoryRegion(
        mem_type="VRAM" if tensor.device.type == "cuda" else "DRAM",
        device_id=tensor.device.index or 0,
        base_address=tensor.data_ptr(),
        block_nbytes=num_segments * segment_nbytes,
        num_blocks=num_blocks,
        tier=tier,
        num_segments=num_segments,
        segment_stride=num_blocks * segment_nbytes if num_segments > 1 else 0,
    )


@dataclass(frozen=True)
class Notification:
    """A notice received from a remote agent."""

    agent_name: str
    message: bytes


XferId = int
"""Names one started read inside the backend that started it."""


class TransferBackend(Protocol):
    """Moves blocks between registered pools. Every method runs on the owning thread."""

    agent_name: str

    def agent_metadata(self) -> bytes:
        """What a peer needs to connect to this agent (opaque bytes)."""
        ...

    def memory_region(self) -> MemoryRegion: ...

    def register_tier(self, tensor: torch.Tensor, tier: KVTier) -> MemoryRegion:
        """Register another tier's blocks (`tensor`: the KV pool's layout with its own number
        of blocks, host memory for HOST) so peers can read them; once, before the handshake
        is published."""
        ...

    def add_peer(
        self,
        agent_name: str,
        agent_metadata: bytes,
        region: MemoryRegion,
        tier_regions: Sequence[MemoryRegion] = (),
    ) -> None:
        """Load a peer's metadata so reads from its pool (and its other tiers' regions) can
        start (idempotent)."""
        ...

    def remove_peer(self, agent_name: str) -> None: ...

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        """Start reading `plan` from its peer; `notif` (if not empty) reaches the peer after
        the read completed. Raises `BackendError`."""
        ...

    def poll(self, xfer: XferId) -> XferStatus: ...

    def descriptor_count(self, xfer: XferId) -> int | None:
        """Descriptors the library actually posted (telemetry), None when unknown."""
        ...

    def release(self, xfer: XferId) -> None:
        """Free a finished (DONE or FAILED) read."""
        ...

    def abort(self, xfer: XferId) -> bool:
        """Cancel an unfinished read; True when its destination blocks are safe to reuse."""
        ...

    def send_notif(self, agent_name: str, message: bytes) -> None:
        """Send a standalone notice. Raises `BackendError` (peer_lost when it is gone)."""
        ...

    def get_notifs(self) -> list[Notification]: ...

    def close(self) -> None: ...


BackendFactory = Callable[[str, "KVCache", "KVTransferConfig"], TransferBackend]
"""Builds the backend of an endpoint on its loop thread: (agent name, KV cache, config)."""
