"""What a role's latency will be at a load and a worker count, from a worker's profile: the
predictive planner's model (planner/predictive.py).

A stated simple model, not the simulator: the load is `LoadForecast` (arrivals/s, mean prompt
and output tokens), spread evenly over the role's workers.

- Prefill (TTFT): each worker is an M/D/1 queue of prompts of the mean length: service time
  `S` = the profile's prefill step for that many tokens (times `serving.prefill_factor`),
  utilization `rho = rate * S / n`, mean wait `rho * S / (2 (1 - rho))`; TTFT = the router hop
  (`serving.request_s`) + the wait + `S`. A worker also has to get back from a long step: the
  prompts that arrive during a step of `burst` tokens (a long prompt, or several at once) make
  the next step, and where a step's time grows faster than its tokens (attention on a CPU, a
  step past the device's sweet spot) that can run away until every step is full and the queue
  only grows. The load is saturated when steps starting at `burst` tokens grow to the token
  budget; steps that settle batched below it are no runaway (their wait is the TTFT
  correction's to see).
- Decode (TPOT): by Little's law a worker runs `B = rate / n * output * step(B)` streams, where
  `step(B)` is the profile's decode step at batch `B` and the mean context (prompt + half the
  output), plus `serving.decode_step_s`; solved by iterating from one stream. TPOT = `step(B)`.
  A batch past `max_num_seqs`, or past the KV pool at the mean request's blocks, is saturated.

Saturation is `math.inf`. What it leaves out: batching several prompts into one prefill step,
local prefills on decode workers, prefix-cache hits and the hand-off; the planner's correction
factors (observed over predicted) absorb what this gets wrong at the cluster's own load.
"""

from __future__ import annotations

import math

from planner.forecast import LoadForecast
from planner.perf_profile import PerfProfile
from vocabulary.numeric import cdiv

_ITERATIONS = 100


class CapacityModel:
    """Predicted TTFT and TPOT (seconds) of a role of `n` workers under a load."""

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile

    def prefill_utilization(self, load: LoadForecast, workers: int) -> float:
        """The share of each prefill worker's time the load keeps busy (may exceed 1)."""
        if workers <= 0:
            return math.inf if load.arrival_rps > 0 else 0.0
        return load.arrival_rps * self._prefill_s(load) / workers

    def recovers(self, load: LoadForecast, workers: int, burst_tokens: float) -> bool:
        """Whether prefill steps that start at `burst_tokens` stay below the profile's token
        budget, shrinking back or settling (the tokens arriving during a step make the next
        one; a step holds at most the budget, so one that reaches it never gets back)."""
        if workers <= 0:
            return load.arrival_rps <= 0
        budget = self.profile.header.max_num_batched_tokens
        prompt = max(load.mean_prompt_tokens, 1.0)
        tokens_per_s = load.arrival_rps / workers * prompt
        step = min(max(burst_tokens, prompt), budget)
        last = step
        for _ in range(_ITERATIONS):
            nxt = tokens_per_s * self._step_tokens_s(step)
            if nxt >= budget:
                return False
            if nxt <= prompt:
                return True
            if abs(nxt - step) < 1e-6:
                return True  # a stable fixed point below the budget: it stays batched there
            step, last = nxt, step
        return step <= last

    def ttft_s(self, load: LoadForecast, workers: int) -> float:
        service = self._prefill_s(load)
        rho = self.prefill_utilization(load, workers)
        if rho >= 1.0:
            return math.inf
        wait = rho * service / (2.0 * (1.0 - rho))
        return self.profile.serving.request_s + wait + service

    def decode_streams(self, load: LoadForecast, workers: int) -> float:
        """Streams each decode worker runs at this load (`math.inf`: saturated)."""
        if workers <= 0:
            return math.inf if load.arrival_rps > 0 else 0.0
        per_worker = load.arrival_rps / workers * max(load.mean_output_tokens, 1.0)
        limit = self._max_streams(load)
        batch = per_worker * self._step_s(1.0, load)
        for _ in range(_ITERATIONS):
            if batch > limit:
                return math.inf
            nxt = per_worker * self._step_s(max(batch, 1.0), load)
            if abs(nxt - batch) < 1e-6:
                return nxt
            batch = nxt
        return batch if batch <= limit else math.inf

    def tpot_s(self, load: LoadForecast, workers: int) -> float:
        batch = self.decode_streams(load, workers)
        if math.isinf(batch):
            return math.inf
        return self._step_s(max(batch, 1.0), load)

    def _prefill_s(self, load: LoadForecast) -> float:
        return self._step_tokens_s(load.mean_prompt_tokens)

    def _step_tokens_s(self, tokens: float) -> float:
        n = max(round(tokens), 1)
        return self.profile.prefill_step_s(n) * self.profile.serving.prefill_factor

    def _step_s(self, batch: float, load: LoadForecast) -> float:
        context = max(load.mean_prompt_tokens + load.mean_output_tokens / 2.0, 1.0)
        step = self.profile.decode_step_s(max(round(batch), 1), context)
        return step + self.profile.serving.decode_step_s

    def _max_streams(self, load: LoadForecast) -> float:
        h = self.profile.header
        tokens = max(round(load.mean_prompt_tokens + load.mean_output_tokens), 1)
        by_kv = h.num_kv_blocks / cdiv(tokens, h.block_size)
        return min(float(h.max_num_seqs), by_kv)
