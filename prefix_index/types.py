"""What a prefix lookup answers (per live worker, how many leading blocks of a prompt's hash
chain it caches) and how a worker's publisher fares (torch-free: the router imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerPrefix:
    """One worker's cached prefix of a prompt: its first `num_blocks` blocks, of which
    `num_host_blocks` are in its host tier only (onboarded before use)."""

    worker_id: str
    num_blocks: int
    num_host_blocks: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """Per live worker, the number of leading blocks of a hash chain it has cached.

    `workers` holds only workers with at least one block, longest prefix first (ties by id).
    `available` is False when the index could not be asked (Redis down): route on load alone.
    """

    chain_length: int
    workers: tuple[WorkerPrefix, ...] = ()
    available: bool = True

    def blocks_cached(self, worker_id: str) -> int:
        """Leading blocks the worker holds, in any tier."""
        for w in self.workers:
            if w.worker_id == worker_id:
                return w.num_blocks
        return 0

    def host_blocks(self, worker_id: str) -> int:
        """Of `blocks_cached`, those in the worker's host tier only."""
        for w in self.workers:
            if w.worker_id == worker_id:
                return w.num_host_blocks
        return 0

    def best(self) -> WorkerPrefix | None:
        return self.workers[0] if self.workers else None
