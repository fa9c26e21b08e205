"""What the engine's steps cost and carry: cumulative step time and batch shape.

`StepMeter` is owned by the engine thread and records every `LLMEngine.step()` that ran a
batch: its wall time (with overlap scheduling, launching step t and reading step t-1), the
requests in it and the tokens it computed, split into prompt tokens (prefill: positions
inside the prompt, also a recomputed last prompt token) and generated tokens (decode).
`StepStats` is its frozen snapshot, carried in `EngineLoad.steps`; the router exports it per
worker as Prometheus histograms and counters (router/worker_metrics.py), so the bucket bounds
below are part of that contract.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the step-time histogram (seconds); one more bucket counts the rest."""
BATCH_REQUESTS_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper bounds of the requests-per-step histogram; one more bucket counts the rest."""


@dataclass(frozen=True)
class StepStats:
    """Cumulative figures of one engine's steps since it started.

    `*_buckets` hold one count per bound of the matching `*_BUCKETS` plus one for larger
    values (not cumulative); empty before the first step."""

    num_steps: int = 0
    step_seconds: float = 0.0
    step_seconds_buckets: tuple[int, ...] = ()
    batch_requests: int = 0
    """Requests summed over steps (mean batch size = batch_requests / num_steps)."""
    batch_requests_buckets: tuple[int, ...] = ()
    prefill_tokens: int = 0
    """Prompt tokens computed."""
    decode_tokens: int = 0
    """Generated tokens computed (one per running request per step)."""


class StepMeter:
    """Mutable counters behind `StepStats` (engine thread only)."""

    def __init__(self) -> None:
        self._num_steps = 0
        self._step_seconds = 0.0
        self._step_buckets = [0] * (len(STEP_SECONDS_BUCKETS) + 1)
        self._batch_requests = 0
        self._batch_buckets = [0] * (len(BATCH_REQUESTS_BUCKETS) + 1)
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._snapshot = StepStats()

    def record(
        self, num_requests: int, prefill_tokens: int, decode_tokens: int, seconds: float
    ) -> None:
        self._num_steps += 1
        self._step_seconds += seconds
        self._step_buckets[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self._batch_requests += num_requests
        self._batch_buckets[bisect.bisect_left(BATCH_REQUESTS_BUCKETS, num_requests)] += 1
        self._prefill_tokens += prefill_tokens
        self._decode_tokens += decode_tokens

    def snapshot(self) -> StepStats:
        """The figures so far (the same object until the next `record`)."""
        if self._snapshot.num_steps != self._num_steps:
            self._snapshot = StepStats(
                num_steps=self._num_steps,
                step_seconds=self._step_seconds,
                step_seconds_buckets=tuple(self._step_buckets),
                batch_requests=self._batch_requests,
                batch_requests_buckets=tuple(self._batch_buckets),
                prefill_tokens=self._prefill_tokens,
                decode_tokens=self._decode_tokens,
            )
        return self._snapshot
