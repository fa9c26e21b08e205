"""Online prefill throughput per worker: the denominator of admission's TTFT estimate.

The router reports each finished prefill (tokens computed, seconds the worker spent on it). The
estimate starts at a prior and moves to the observations: the first ones are averaged (weight
1/(n+1), the prior counting as one), later ones enter an EWMA of weight `alpha`, so an early
outlier cannot pin it and a slow drift (longer prompts, a warm cache) is followed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThroughputEstimate:
    tokens_per_s: float
    samples: int
    """Observations folded in (0: still the prior)."""


class PrefillThroughputEstimator:
    """Learned prefill tokens/s per worker id."""

    def __init__(self, prior_tokens_per_s: float = 10_000.0, alpha: float = 0.2) -> None:
        if prior_tokens_per_s <= 0:
            raise ValueError(f"prior_tokens_per_s: must be > 0, got {prior_tokens_per_s}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: must be in (0, 1], got {alpha}")
        self._prior = prior_tokens_per_s
        self._alpha = alpha
        self._estimates: dict[str, ThroughputEstimate] = {}

    def observe(self, worker_id: str, tokens: int, seconds: float) -> ThroughputEstimate:
        """Fold one finished prefill in; ignores empty or non-positive samples."""
        current = self.estimate(worker_id)
        if tokens <= 0 or seconds <= 0:
            return current
        rate = tokens / seconds
        weight = max(self._alpha, 1.0 / (current.samples + 2))
        updated = ThroughputEstimate(
            tokens_per_s=(1.0 - weight) * current.tokens_per_s + weight * rate,
            samples=current.samples + 1,
        )
        self._estimates[worker_id] = updated
        return updated

    def estimate(self, worker_id: str) -> ThroughputEstimate:
        return self._estimates.get(worker_id, ThroughputEstimate(self._prior, 0))

    def tokens_per_s(self, worker_id: str) -> float:
        """The value to put in `PrefillWorkerLoad.throughput_tokens_per_s`."""
        return self.estimate(worker_id).tokens_per_s

    def forget(self, worker_id: str) -> None:
        """Drop a worker that left the cluster."""
        self._estimates.pop(worker_id, None)
