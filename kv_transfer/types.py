"""Values that cross the kv_transfer boundary (frozen; safe to pickle through Ray).

- `KVHandle`: what a prefill worker returns with the first token: where the prompt's KV lives,
  for how long it is leased, and which layout it has.
- `TransferPlan`: what a decode worker will pull for one handle (remote ids → local ids, after
  skipping the blocks it reuses, coalesced into descriptor runs).
- `PrefixMatch`: per live worker, how many leading blocks of a prompt it has cached.
- `TransferLoad`: a decode endpoint's transfer load, for admission and placement.
- `compat_hash`: the fingerprint of everything two pools must agree on to exchange blocks.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash

if TYPE_CHECKING:  # engine.kv_cache imports torch; the router imports this module without it
    from engine.kv_cache import KVCacheSpec


def compat_fields(spec: KVCacheSpec, model_id: str) -> str:
    """The human-readable text that `compat_hash` hashes: `key=value` pairs joined by `;`.

    The pool's `num_blocks` is not part of it: two workers may have pools of any size. A
    tensor-parallel pool adds its TP size (its `num_kv_heads` are one rank's): a hand-off
    between TP layouts is refused until cross-layout pulls exist; the rank is not part of it
    (a worker has one hash, rank r pulls from rank r). A pool of one rank has no `tp_size`
    field, so its hash is what it was before tensor parallelism.
    """
    return ";".join(
        [
            f"model={model_id}",
            f"dtype={spec.dtype}",
            f"layout={spec.layout}",
            f"block_size={spec.block_size}",
            f"num_layers={spec.num_layers}",
            f"num_kv_heads={spec.num_kv_heads}",
            f"head_dim={spec.head_dim}",
            *([f"kv_scales={_digest(spec.scales)}"] if spec.scales else []),
            *([f"tp_size={spec.tp_size}"] if spec.tp_size > 1 else []),
        ]
    )


def _digest(scales: tuple[float, ...]) -> str:
    """12 hex digits over an e4m3 pool's scales (their exact float64 bits)."""
    return hashlib.sha256(struct.pack(f"<{len(scales)}d", *scales)).hexdigest()[:12]


def compat_hash(spec: KVCacheSpec, model_id: str) -> str:
    """32 hex digits over model, dtype, layout, block size, layers, kv heads, head dim, an
    e4m3 pool's scales and a TP pool's TP size."""
    return hashlib.sha256(compat_fields(spec, model_id).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class KVHandle:
    """The KV of one prefilled prompt, held by a prefill worker under a lease.

    `block_ids` covers every token (the last block may be partial); `block_hashes` covers the
    full blocks only, so `len(block_hashes) <= len(block_ids)`. `lease_deadline` is wall-clock
    (`time.time()`), because it crosses processes; heartbeats from the decode side move it on
    the prefill side, so a decode endpoint treats it as a lower bound it keeps extending.
    """

    request_id: str
    worker_id: str
    agent_name: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int
    lease_deadline: float
    compat_hash: str

    def __post_init__(self) -> None:
        if not self.block_ids:
            raise ValueError("KVHandle needs at least one block")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError(
                f"KVHandle has {len(self.block_hashes)} hashes for {len(self.block_ids)} blocks"
            )
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("KVHandle block_ids contain duplicates")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class DescriptorRun:
    """`num_blocks` consecutive blocks on both sides: one transfer descriptor."""

    remote_start: int
    local_start: int
    num_blocks: int


@dataclass(frozen=True)
class TransferPlan:
    """What a decode endpoint pulls for one handle.

    `remote_block_ids[i]` is read into `local_block_ids[i]`; the first `num_reused` blocks of
    the handle are not transferred (the decode worker already holds them). `runs` is the same
    mapping coalesced into descriptors: adjacent ids on both sides share one descriptor.
    """

    request_id: str
    peer: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_reused: int
    runs: tuple[DescriptorRun, ...]
    block_nbytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def num_descriptors(self) -> int:
        return len(self.runs)


@dataclass(frozen=True)
class PeerLoad:
    """Transfer load towards one prefill peer (agent name)."""

    peer: str
    in_flight_transfers: int
    in_flight_blocks: int
    in_flight_bytes: int
    queued_transfers: int
    queued_blocks: int


@dataclass(frozen=True)
class TransferLoad:
    """A decode endpoint's transfer load and budget, for admission and placement."""

    in_flight_transfers: int = 0
    in_flight_blocks: int = 0
    in_flight_bytes: int = 0
    queued_transfers: int = 0
    queued_blocks: int = 0
    queued_bytes: int = 0
    max_inflight_blocks: int = 0
    max_inflight_bytes: int = 0
    per_peer: tuple[PeerLoad, ...] = ()

    @property
    def pending_blocks(self) -> int:
        """Blocks this endpoint still has to pull (queued + in flight)."""
        return self.in_flight_blocks + self.queued_blocks
