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

from engine.kv_events import KVTier
from kv_transfer.types import TransferPlan

if TYPE_CHECKING:
    import torch

    from engine.kv_cache import KVCache
    from kv_transfer.config import KVTransferConfig


class XferStatus(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class DescriptorMode(enum.Enum):
    """How a read's descriptors are built (kv_transfer/nixl_backend.py says why PREPPED)."""

    PREPPED = "prepped"  # per-block dlists prepared once per peer; NIXL merges adjacent ones
    COALESCED = "coalesced"  # one descriptor per `DescriptorRun`, built per transfer
    PER_BLOCK = "per_block"  # one descriptor per block, built per transfer (benchmark only)


@dataclass(frozen=True)
class MemoryRegion:
    """A registered KV region of an agent: `num_blocks` blocks of `block_nbytes` from `base`.

    This is the compact form of the agent's descriptor list: block `i` is the descriptor
    `(base_address + i * block_nbytes, block_nbytes, device_id)` of memory type `mem_type`.
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
        """Register another tier's blocks (`tensor`: [num_blocks, *block], host memory for
        HOST) so peers can read them; once, before the handshake is published."""
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
