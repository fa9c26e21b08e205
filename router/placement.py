"""Placement: which prefill worker computes a prompt and which decode worker serves it.

Pure functions over candidate snapshots (the Place step of router/orchestrator.py):

    prefill cost = w * uncached_prompt_blocks + w_host * host_tier_blocks
                   + queued_prefill_tokens / block_size + w_lora * [adapter not held]
    decode cost  = active KV blocks + in-flight transfer blocks + w_lora * [adapter not held]

The decode worker is chosen first (least cost; ties go to the longer cached prefix, then to
the id for determinism). Conditional disaggregation: when the part of the prompt the chosen
decode worker has not cached is at most `local_prefill_threshold_tokens`, the decode worker
prefills it itself and no transfer happens. A split worker (both loops on one device)
prefills what it decodes, unless a prefill worker caches a longer prefix of the prompt: then
that one prefills and the split worker pulls the KV. Otherwise the prefill worker with the
least cost is chosen, so a worker that already holds a long prefix wins unless it is much
busier. A prefix block a worker holds only in its host tier costs `w_host` (an onboard: a
host→device copy, far cheaper than computing it, dearer than a device hit), so a host-tier
holder beats a cold worker and loses to one that has the block on its device.
A request on a LoRA adapter goes only to workers that have the adapter registered (the router
filters the candidates); one whose adapter cache does not hold it yet (a read from disk before
the request runs) costs `w_lora` more, so the workers already holding it are preferred.
With no live prefill worker the decode worker prefills locally (degraded, not failed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCandidate:
    worker_id: str
    cached_blocks: int
    """Leading prompt blocks this worker holds, in any tier (from the Redis prefix index)."""
    queued_prefill_tokens: int
    host_blocks: int = 0
    """Of `cached_blocks`, those in its host tier only (onboarded before use)."""
    cold_lora: bool = False
    """The request's LoRA adapter is registered here but not in the adapter cache."""


@dataclass(frozen=True)
class DecodeCandidate:
    worker_id: str
    cached_blocks: int
    active_kv_blocks: int
    inflight_transfer_blocks: int
    free_kv_blocks: int
    cold_lora: bool = False
    """The request's LoRA adapter is registered here but not in the adapter cache."""
    prefills_locally: bool = False
    """A split worker: it prefills on a loop of its own beside its decodes, so a prompt it
    decodes is prefilled there too unless a prefill worker caches more of it."""


@dataclass(frozen=True)
class PlacementConfig:
    uncached_block_weight: float = 4.0
    """w: the cost of one uncached prompt block relative to one block of queued prefill."""
    local_prefill_threshold_tokens: int = 0
    """Uncached prompt tokens at or below which the decode worker prefills locally (0: never)."""
    host_block_weight: float = 0.25
    """w_host: the cost of one host-tier prompt block (its onboard) on the same scale."""
    cold_lora_weight: float = 16.0
    """w_lora: the cost of a worker that must read the request's adapter first."""


@dataclass(frozen=True)
class Placement:
    decode_worker_id: str
    prefill_worker_id: str | None
    """None when the decode worker prefills locally."""
    cached_blocks: int
    """Leading prompt blocks already cached where the prompt will be computed."""
    uncached_tokens: int
    """Prompt tokens that will be computed (the rest comes from a prefix cache)."""

    @property
    def local_prefill(self) -> bool:
        return self.prefill_worker_id is None


class NoWorkerError(Exception):
    """No live worker of a role is available (maps to UNAVAILABLE)."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no live {role} worker")
        self.role = role


def prefill_cost(
    c: PrefillCandidate,
    prompt_blocks: int,
    block_size: int,
    w: float,
    w_host: float = 0.0,
    w_lora: float = 0.0,
) -> float:
    cached = min(c.cached_blocks, prompt_blocks)
    host = min(c.host_blocks, cached)
    queued = c.queued_prefill_tokens / block_size
    return w * (prompt_blocks - cached) + w_host * host + queued + w_lora * c.cold_lora


def decode_cost(c: DecodeCandidate, w_lora: float = 0.0) -> float:
    return float(c.active_kv_blocks + c.inflight_transfer_blocks) + w_lora * c.cold_lora


def place(
    prompt_tokens: int,
    block_size: int,
    prefill: Sequence[PrefillCandidate],
    decode: Sequence[DecodeCandidate],
    config: PlacementConfig,
    needed_decode_blocks: int = 0,
) -> Placement:
    """Choose workers for a prompt of `prompt_tokens` tokens.

    Decode workers without `needed_decode_blocks` free blocks are skipped unless none has
    them (admission has already reserved capacity; this only steers away from full workers).
    Raises NoWorkerError when there is no decode candidate.
    """
    if not decode:
        raise NoWorkerError("decode")
    roomy = [d for d in decode if d.free_kv_blocks >= needed_decode_blocks] or list(decode)
    w_lora = config.cold_lora_weight
    dec = min(roomy, key=lambda d: (decode_cost(d, w_lora), -d.cached_blocks, d.worker_id))
    full_blocks = prompt_tokens // block_size
    local_cached = min(dec.cached_blocks, full_blocks)
    local_uncached = prompt_tokens - local_cached * block_size
    better = [p for p in prefill if min(p.cached_blocks, full_blocks) > local_cached]
    if (
        local_uncached <= config.local_prefill_threshold_tokens
        or not prefill
        or (dec.prefills_locally and not better)
    ):
        # Short uncached remainder, no live prefill worker, or a split worker that caches as
        # much of the prompt as any prefill worker: the decode worker prefills (its engine
        # runs colocated-capable, or split), so losing every prefill worker degrades
        # throughput instead of failing requests.
        return Placement(dec.worker_id, None, local_cached, local_uncached)
    if dec.prefills_locally:
        prefill = better
    pre = min(
        prefill,
        key=lambda p: (
            prefill_cost(
                p,
                full_blocks,
                block_size,
                config.uncached_block_weight,
                config.host_block_weight,
                w_lora,
            ),
            p.worker_id,
        ),
    )
    cached = min(pre.cached_blocks, full_blocks)
    return Placement(dec.worker_id, pre.worker_id, cached, prompt_tokens - cached * block_size)
