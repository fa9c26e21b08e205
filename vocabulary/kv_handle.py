"""`KVHandle`: where one prefilled prompt's KV lives, what a prefill worker returns with the
first token and the decode side pulls from (kv_transfer/plan.py turns it into reads)."""

from __future__ import annotations

from dataclasses import dataclass

from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVTier


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
    rank_agents: tuple[str, ...] = ()
    """The agent of each tensor-parallel rank of the prefill worker, rank 0 (`agent_name`,
    which holds the lease and takes the notices) first; empty for a worker of one rank."""
    block_tiers: tuple[KVTier, ...] = ()
    """Per block, the tier (the region of the prefill agent) its id indexes: its KV pool, or
    its host tier (a copy the lease holds there instead of a device block); empty: every
    block is in the KV pool."""

    def __post_init__(self) -> None:
        if self.rank_agents and self.rank_agents[0] != self.agent_name:
            raise ValueError("KVHandle rank_agents must start with agent_name (rank 0)")
        if not self.block_ids:
            raise ValueError("KVHandle needs at least one block")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError(
                f"KVHandle has {len(self.block_hashes)} hashes for {len(self.block_ids)} blocks"
            )
        if self.block_tiers and len(self.block_tiers) != len(self.block_ids):
            raise ValueError(
                f"KVHandle has {len(self.block_tiers)} tiers for {len(self.block_ids)} blocks"
            )
        if len(set(zip(self.tiers, self.block_ids, strict=True))) != len(self.block_ids):
            raise ValueError("KVHandle block_ids contain duplicates")

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        """The tier of every block (`block_tiers`, or all DEVICE)."""
        return self.block_tiers or (KVTier.DEVICE,) * len(self.block_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def agents(self) -> tuple[str, ...]:
        """The agent of every prefill rank, rank 0 first."""
        return self.rank_agents or (self.agent_name,)
