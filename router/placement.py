"""Placement: which prefill worker computes a prompt and which decode worker serves it.

Pure functions over candidate snapshots (the Place step of router/orchestrator.py):

    prefill cost = w * uncached_prompt_blocks + w_host * host_tier_blocks
                   + queued_prefill_tokens / block_size + w_lora * [adapter not held]
    decode cost  = active KV blocks + in-flight transfer blocks + w_lora * [adapter not held]

The decode worker is chosen first (least cost; ties go to the longer cached prefix, then to
the id for determinism). Conditional disaggregation (router/prefill_cost.py): the decode
worker prefills the prompt itself, and no transfer happens, when the policy says so: under
`threshold` when the part of the prompt it has not cached is at most
`local_prefill_threshold_tokens`; under `cost` when that is predicted to delay requests less
than the least-cost prefill worker and the hand-off. A split worker (both loops on one device)
prefills what it decodes, unless a prefill worker caches a longer prefix of the prompt: then
that one prefills and the split worker pulls the KV. Otherwise the prefill worker with the
least cost is chosen, so a worker that already holds a long prefix wins unless it is much
busier. Every placement says why it went where it went (`PrefillReason`).
A prefix block a worker holds only in its host tier costs `w_host` (an onboard: a
host→device copy, far cheaper than computing it, dearer than a device hit), so a host-tier
holder beats a cold worker and loses to one that has the block on its device.
A request on a LoRA adapter goes only to workers that have the adapter registered (the router
filters the candidates); one whose adapter cache does not hold it yet (a read from disk before
the request runs) costs `w_lora` more, so the workers already holding it are preferred.
With no live prefill worker the decode worker prefills locally (degraded, not failed).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.prefill_cost import (
    LocalPrefillPolicy,
    PrefillCostModel,
    PrefillEstimate,
    PrefillLoad,
    estimate,
)


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
    running_requests: int = 0
    """Streams it decodes, and those placed on it that it does not report yet (the ones a
    local prefill would stall)."""
    queued_prefill_tokens: int = 0
    """Prompt tokens it has yet to compute (local prefills ahead of a new one)."""


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
    local_prefill_policy: LocalPrefillPolicy = LocalPrefillPolicy.THRESHOLD
    """How a local prefill is chosen; `cost` without `prefill_cost` is the threshold."""
    prefill_cost: PrefillCostModel | None = None
    """The step times the `cost` policy predicts with."""
    stall_weight: float = 1.0
    """`cost`: a running stream's wait against the request's own (LocalPrefillConfig)."""
    allow_local: bool = True
    """False once the request's first token is out (its decode worker must go on after that
    token): only a split worker or the lack of a prefill worker then prefills locally."""

    @property
    def cost_model(self) -> PrefillCostModel | None:
        """What the policy predicts with (None: the threshold decides)."""
        by_cost = self.local_prefill_policy is LocalPrefillPolicy.COST
        return self.prefill_cost if by_cost else None


class PrefillReason(enum.Enum):
    """Why a prompt is prefilled where it is (`pdserve_prefill_placements_total{reason}`)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    """Local: no live prefill worker (degraded, not failed)."""
    UNDER_THRESHOLD = "under_threshold"
    """Local: `threshold`, the uncached prompt is at most the threshold."""
    OVER_THRESHOLD = "over_threshold"
    """Remote: `threshold`, the uncached prompt is longer."""
    LOCAL_CHEAPER = "local_cheaper"
    """Local: `cost`, predicted to delay requests less."""
    REMOTE_CHEAPER = "remote_cheaper"
    """Remote: `cost`, predicted to delay requests less (or as little)."""
    SPLIT_WORKER = "split_worker"
    """Local: a split worker, and no prefill worker caches more of the prompt."""
    LONGER_PREFIX = "longer_prefix"
    """Remote: a split worker, but a prefill worker caches more of the prompt."""
    FIRST_TOKEN_OUT = "first_token_out"
    """Remote: a retry after the first token (its decode worker goes on after that token)."""

    @property
    def local(self) -> bool:
        return self in _LOCAL_REASONS


_LOCAL_REASONS = frozenset(
    {
        PrefillReason.NO_PREFILL_WORKER,
        PrefillReason.UNDER_THRESHOLD,
        PrefillReason.LOCAL_CHEAPER,
        PrefillReason.SPLIT_WORKER,
    }
)


@dataclass(frozen=True)
class Placement:
    decode_worker_id: str
    prefill_worker_id: str | None
    """None when the decode worker prefills locally."""
    cached_blocks: int
    """Leading prompt blocks already cached where the prompt will be computed."""
    uncached_tokens: int
    """Prompt tokens that will be computed (the rest comes from a prefix cache)."""
    reason: PrefillReason = PrefillReason.OVER_THRESHOLD
    estimate: PrefillEstimate | None = None
    """The `cost` policy's prediction (None under `threshold`)."""

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

    def local(reason: PrefillReason, est: PrefillEstimate | None = None) -> Placement:
        # The decode worker prefills (its engine runs colocated-capable, or split), so losing
        # every prefill worker degrades throughput instead of failing requests.
        return Placement(dec.worker_id, None, local_cached, local_uncached, reason, est)

    if not prefill:
        return local(PrefillReason.NO_PREFILL_WORKER)
    model = config.cost_model
    threshold = config.local_prefill_threshold_tokens
    if config.allow_local and model is None and local_uncached <= threshold:
        return local(PrefillReason.UNDER_THRESHOLD)
    why = PrefillReason.OVER_THRESHOLD
    if dec.prefills_locally:
        better = [p for p in prefill if min(p.cached_blocks, full_blocks) > local_cached]
        if not better:
            return local(PrefillReason.SPLIT_WORKER)
        prefill, why = better, PrefillReason.LONGER_PREFIX
    elif not config.allow_local:
        why = PrefillReason.FIRST_TOKEN_OUT
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
    est = None
    if why is PrefillReason.OVER_THRESHOLD and model is not None:
        est = estimate(model, prompt_tokens, block_size, _load(dec, pre), config.stall_weight)
        if est.local:
            return local(PrefillReason.LOCAL_CHEAPER, est)
        why = PrefillReason.REMOTE_CHEAPER
    cached = min(pre.cached_blocks, full_blocks)
    return Placement(
        dec.worker_id, pre.worker_id, cached, prompt_tokens - cached * block_size, why, est
    )


def _load(dec: DecodeCandidate, pre: PrefillCandidate) -> PrefillLoad:
    return PrefillLoad(
        decode_cached_blocks=dec.cached_blocks,
        decode_queued_prefill_tokens=dec.queued_prefill_tokens,
        decode_running=dec.running_requests,
        decode_kv_blocks=dec.active_kv_blocks,
        decode_transfer_blocks=dec.inflight_transfer_blocks,
        prefill_cached_blocks=pre.cached_blocks,
        prefill_queued_tokens=pre.queued_prefill_tokens,
    )
