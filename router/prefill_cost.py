"""Conditional disaggregation by predicted cost: a prompt is prefilled on its decode worker
(local) or on a prefill worker (remote), whichever is predicted to delay requests less.

Two policies (router `orchestrator.local_prefill.policy`, `pdserve up --local-prefill-policy`):

- `threshold`: local when the part of the prompt the decode worker has not cached is at most
  the admission threshold `local_prefill_threshold_tokens`, whatever the load;
- `cost`: the predicted delay of each way, in request-seconds (a delay summed over the
  requests it falls on), from a worker's measured profile (`pdserve profile`, turned into a
  `PrefillCostModel` by planner/perf_profile.py `PerfProfile.prefill_cost_model`) and the
  load the router already polls:

      local  = the decode worker's queued prefill and this prompt, computed there, plus
               the decode part of those steps                  (this request's first token)
             + stall_weight * streams on it * what this prompt adds to its steps
                                                  (each of them waits that long for a token)
      remote = the prefill worker's queued prefill and this prompt, computed there
                                                               (this request's first token)
             + the hand-off: fixed + per block * (blocks it pulls + blocks that decode worker
               is pulling already)                            (this request's second token)

  The cheaper way wins (a tie goes remote). Without a profile the policy is the threshold.

An idle decode worker therefore prefills a prompt itself (it saves the hand-off and stalls
nobody); a busy one sends even short prompts to an idle prefill worker; a backed-up prefill
worker leaves medium prompts to decode workers with few streams. What the model does not
see: requests that arrive during a long local prefill (only those already placed on the
decode worker count as stalled), and a prefill's slowdown of a decode worker that shares
its cores or its device (two workers are independent here).

Pure and torch-free: the router's placement (router/placement.py) and the simulator call
`estimate` on the same values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vocabulary.numeric import cdiv, interpolate, interpolate_2d


class LocalPrefillPolicy(enum.Enum):
    """How placement chooses between a local prefill and a prefill worker."""

    THRESHOLD = "threshold"
    COST = "cost"


@dataclass(frozen=True)
class PrefillCostModel:
    """A worker's step times as placement reads them: a profile's curves with its serving
    overheads applied (the prefill factor to every prefill time, the per-step overhead to
    every decode step)."""

    source: str
    """What it was made from (model, dtype, device, file), for logs."""
    token_budget: int
    """Prompt tokens of one step (a longer prefill is chunked at it)."""
    prefill_tokens: tuple[int, ...]
    """Tokens computed in one prefill step, ascending ..."""
    prefill_s: tuple[float, ...]
    """... and that step's seconds (no cached prefix)."""
    prefill_s_per_cached_token: float
    """What attending to one cached prefix token adds to a prefill step."""
    decode_contexts: tuple[int, ...]
    """Context lengths of the decode grid, ascending ..."""
    decode_batches: tuple[tuple[int, ...], ...]
    """... for each, batch sizes ascending ..."""
    decode_s: tuple[tuple[float, ...], ...]
    """... and the step seconds."""
    handoff_fixed_s: float
    handoff_per_block_s: float

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget: must be >= 1, got {self.token_budget}")
        if not self.prefill_tokens or len(self.prefill_tokens) != len(self.prefill_s):
            raise ValueError("prefill_s: one time per point of prefill_tokens (at least one)")
        shape = [len(b) for b in self.decode_batches]
        if not self.decode_contexts or len(self.decode_contexts) != len(self.decode_batches):
            raise ValueError("decode_batches: one row per point of decode_contexts (at least one)")
        if not all(shape) or shape != [len(s) for s in self.decode_s]:
            raise ValueError("decode_s: one time per batch size of each row")
        if self.handoff_fixed_s < 0 or self.handoff_per_block_s < 0:
            raise ValueError("handoff_fixed_s: the hand-off's times must be >= 0")

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """Computing `tokens` prompt tokens behind `cached` cached ones, chunked at the budget
        (each chunk attends to what came before it). 0 for no tokens."""
        total, done = 0.0, 0
        while done < tokens:
            chunk = min(self.token_budget, tokens - done)
            step = interpolate(self.prefill_tokens, self.prefill_s, chunk)
            total += step + self.prefill_s_per_cached_token * (cached + done)
            done += chunk
        return total

    def decode_step_seconds(self, batch: int, context: float) -> float:
        """One decode step of `batch` streams of `context` tokens each; 0 for no streams."""
        if batch <= 0:
            return 0.0
        rows = list(zip(self.decode_batches, self.decode_s, strict=True))
        return interpolate_2d(self.decode_contexts, rows, context, batch)

    def handoff_seconds(self, blocks: int) -> float:
        return self.handoff_fixed_s + self.handoff_per_block_s * blocks


@dataclass(frozen=True)
class LocalPrefillConfig:
    """How the router chooses where a prompt is prefilled (router/prefill_cost.py)."""

    policy: str = LocalPrefillPolicy.THRESHOLD.value
    """`threshold`: local when the uncached prompt is at most the admission threshold
    `local_prefill_threshold_tokens`; `cost`: the way predicted to delay requests less,
    from `profile` (without one: the threshold)."""
    profile: str | None = None
    """The `pdserve profile` file of the workers, read by `pdserve up` for the `cost` policy
    (one made for another model, block size, TP or dtype is refused)."""
    stall_weight: float = 1.0
    """`cost`: what one running stream's wait for a local prefill counts against a second
    of the request's own delay."""
    cost: PrefillCostModel | None = None
    """Made from `profile` by `pdserve up` (not read from a file)."""

    def __post_init__(self) -> None:
        known = [p.value for p in LocalPrefillPolicy]
        if self.policy not in known:
            raise ValueError(f"policy: one of {', '.join(known)}, got {self.policy!r}")
        if not self.stall_weight >= 0:
            raise ValueError(f"stall_weight: must be >= 0, got {self.stall_weight}")

    @property
    def kind(self) -> LocalPrefillPolicy:
        return LocalPrefillPolicy(self.policy)


@dataclass(frozen=True)
class PrefillEstimate:
    """The predicted delays, in seconds, of prefilling one prompt locally or remotely."""

    local_wait_s: float
    """Until its first token on the decode worker."""
    stall_s: float
    """What its prefill adds to the decode worker's steps."""
    stalled_streams: int
    """Streams on the decode worker that wait `stall_s` for their next token."""
    remote_wait_s: float
    """Until its first token on the prefill worker."""
    handoff_s: float
    """From that first token until its KV is on the decode worker."""
    stall_weight: float = 1.0

    @property
    def local_s(self) -> float:
        return self.local_wait_s + self.stall_weight * self.stalled_streams * self.stall_s

    @property
    def remote_s(self) -> float:
        return self.remote_wait_s + self.handoff_s

    @property
    def local(self) -> bool:
        return self.local_s < self.remote_s


@dataclass(frozen=True)
class PrefillLoad:
    """What `estimate` reads of the two workers (placement's candidates carry it)."""

    decode_cached_blocks: int
    decode_queued_prefill_tokens: int
    decode_running: int
    """Streams on the decode worker: running, and placed there but not yet running."""
    decode_kv_blocks: int
    """KV blocks in use on the decode worker (their mean context is this over `decode_running`)."""
    decode_transfer_blocks: int
    """Blocks it is pulling (or about to) for other requests."""
    prefill_cached_blocks: int
    prefill_queued_tokens: int


def estimate(
    model: PrefillCostModel,
    prompt_tokens: int,
    block_size: int,
    load: PrefillLoad,
    stall_weight: float = 1.0,
) -> PrefillEstimate:
    """The delays of a prompt of `prompt_tokens` tokens prefilled on its decode worker or on
    the prefill worker `load` describes (the module docstring has the sums). A fully cached
    prompt still computes its last token."""
    full = prompt_tokens // block_size
    local_cached = min(load.decode_cached_blocks, full) * block_size
    local_tokens = max(prompt_tokens - local_cached, 1)
    behind = load.decode_queued_prefill_tokens
    local_prefill_s = model.prefill_seconds(behind + local_tokens, local_cached)
    running = load.decode_running
    context = load.decode_kv_blocks * block_size / running if running else 0.0
    steps = cdiv(behind + local_tokens, model.token_budget)
    remote_cached = min(load.prefill_cached_blocks, full) * block_size
    remote_tokens = max(prompt_tokens - remote_cached, 1)
    pulled = max(cdiv(prompt_tokens, block_size) - load.decode_cached_blocks, 0)
    return PrefillEstimate(
        local_wait_s=local_prefill_s + steps * model.decode_step_seconds(running, context),
        stall_s=local_prefill_s - model.prefill_seconds(behind),
        stalled_streams=running,
        remote_wait_s=model.prefill_seconds(
            load.prefill_queued_tokens + remote_tokens, remote_cached
        ),
        handoff_s=model.handoff_seconds(pulled + load.decode_transfer_blocks),
        stall_weight=stall_weight,
    )
