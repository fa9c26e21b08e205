"""The predictive planner's pure core: the reactive rules (planner/core.py) as a guard, and per
role a worker target set ahead of the load.

Each tick:

1. observe: the arrival rate and the mean prompt and output lengths of the tick
   (`TickInput.arrival_rps`, `mean_prompt_tokens`, `mean_output_tokens`) update a Holt forecast
   of each (planner/forecast.py);
2. correct: the tick's new warm samples give the observed TTFT and TPOT at the SLO's
   percentile; over the mean the capacity model (planner/capacity.py) predicts at the observed
   load with the workers that serve now, each is a correction factor (the model's error and
   the tail the percentile sees), smoothed (`correction_alpha`) and bounded;
3. target: the fewest workers per role whose predicted latency, times its correction, is
   within `target_ratio` of the SLO (and, for prefill, whose utilization is within
   `max_utilization` and whose steps recover from a step of `burst_prompts` prompts), at the
   larger of the forecast `startup_s` + one tick ahead (a worker asked for now serves from
   then; the trend damped over `trend_damping_s`) and the load now; decode, besides, must not
   saturate at that arrival rate plus `headroom_z` times the forecast's error a lead ahead (the
   arrival series' residual spread, grown as a random walk's by the root of the ticks in the
   lead), since a decode worker short of streams or KV stalls admission for every request, not
   only its own, where a TPOT over the target costs only the SLO;
4. decide: the reactive rules run as they would alone (`plan`); when they add workers (an SLO
   breach, a queue, the bounds) the larger add wins; otherwise the role grows to its target at
   once, or drains down towards it by at most `drain_step` workers, not within `cooldown_ticks`
   of the role's last change; decode only once its target has stayed below its count for
   `startup_s` (a worker drained now takes that long to come back and one too few stalls
   admission, so a shorter dip is ridden out; a prefill shortfall is a queue the guard sees).
   Drained workers are stopped as the reactive rules say.

Pure: `plan_predictive` depends on its arguments only.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field, replace

from planner.capacity import CapacityModel
from planner.core import (
    PlannerConfig,
    PlannerMemory,
    Role,
    RoleDecision,
    ScalingActuator,
    ScalingDecision,
    TickInput,
    apply_decision,
    pick_drain,
    plan,
    warm_samples,
)
from planner.forecast import HoltState, LoadForecast
from planner.perf_profile import PerfProfile
from vocabulary.numeric import percentile

log = logging.getLogger(__name__)


class PlannerMode(enum.Enum):
    """Which planner the controller runs (`planner.mode`)."""

    REACTIVE = "reactive"
    """The rules of planner/core.py alone: scale on latency, queue and rate over the SLO."""
    PREDICTIVE = "predictive"
    """Targets from a profile at a forecast load, set ahead; the reactive rules as a guard."""


@dataclass(frozen=True)
class PredictiveConfig:
    """The predictive planner's settings (`planner.predictive`; used when `mode` is
    `predictive`)."""

    profile: str | None = None
    """A worker's profile (`pdserve profile`): the model the targets come from. Required in
    predictive mode."""
    startup_s: float = 30.0
    """Seconds from asking for a worker to its serving (the lead time of the forecast)."""
    alpha: float = 0.5
    """Holt's level smoothing, in (0, 1]."""
    beta: float = 0.3
    """Holt's trend smoothing, in [0, 1]."""
    correction_alpha: float = 0.3
    """Weight of a tick's observed/predicted ratio in the smoothed correction, in (0, 1]."""
    min_correction: float = 0.5
    max_correction: float = 8.0
    """Bounds of a correction factor."""
    target_ratio: float = 0.8
    """The predicted latency (corrected: at the SLO's percentile) may take this share of the
    SLO (the rest is the forecast's error)."""
    max_utilization: float = 0.8
    """Most of a prefill worker's time the forecast load may keep busy."""
    burst_prompts: float = 8.0
    """A prefill step this many mean prompts long (a long prompt, a burst; at most the token
    budget) must not grow into full steps at the forecast load (planner/capacity.py:
    `CapacityModel.recovers`)."""

    headroom_z: float = 1.64
    """Decode must not saturate (its streams past `max_num_seqs` or the KV pool) at the
    arrival forecast plus this many of its standard errors a lead ahead (1.64: the one-sided
    95% point of a normal error). Only saturation, not the TPOT target, carries the margin: a
    saturated decode worker stalls admission for every request until a start-up brings
    another, while a TPOT past the target at a load above the forecast costs those requests'
    SLO, which the correction and the guard then see."""
    trend_damping_s: float = 30.0
    """The forecast's trend fades over this many seconds ahead (a damped trend,
    planner/forecast.py; `inf`: Holt's straight line). A trend seen over the last few ticks
    holds near at hand; a step in the load (a burst), which Holt reads as a steep trend, would
    otherwise be carried a whole lead ahead, and the workers asked for on it serve a start-up
    later, often once the step has passed. 30 s (the default start-up): a trend still carries
    59% of a 35 s lead."""
    drain_step: int = 4
    """Most workers a role drains at one tick towards its target. The reactive rules' step
    (`max_step`, 2) is a blind rule's; the target here is the model's, and every tick a role
    waits over it costs the extra workers' seconds. 4 bounds what one tick's noisy forecast can
    take from a role at once (the guard adds back what a queue or a breach shows)."""

    def __post_init__(self) -> None:
        if self.headroom_z < 0:
            raise ValueError(f"headroom_z: must be >= 0, got {self.headroom_z}")
        if self.startup_s < 0:
            raise ValueError(f"startup_s: must be >= 0, got {self.startup_s}")
        if not (0 < self.alpha <= 1 and 0 <= self.beta <= 1 and 0 < self.correction_alpha <= 1):
            raise ValueError("alpha, correction_alpha: must be in (0, 1]; beta in [0, 1]")
        if not 0 < self.min_correction <= 1 <= self.max_correction:
            raise ValueError("min_correction/max_correction: need 0 < min <= 1 <= max")
        if not (0 < self.target_ratio <= 1 and 0 < self.max_utilization < 1):
            raise ValueError("target_ratio: must be in (0, 1]; max_utilization in (0, 1)")
        if self.burst_prompts < 1:
            raise ValueError(f"burst_prompts: must be >= 1, got {self.burst_prompts}")
        if not self.trend_damping_s > 0:
            raise ValueError(f"trend_damping_s: must be > 0, got {self.trend_damping_s}")
        if self.drain_step < 1:
            raise ValueError(f"drain_step: must be >= 1, got {self.drain_step}")


@dataclass(frozen=True)
class PredictiveMemory:
    """What the predictive planner carries between ticks."""

    reactive: PlannerMemory = field(default_factory=PlannerMemory)
    """The reactive rules' memory (every change counts for their cooldown)."""
    arrival: HoltState = field(default_factory=HoltState)
    prompt: HoltState = field(default_factory=HoltState)
    output: HoltState = field(default_factory=HoltState)
    ttft_correction: float = 1.0
    tpot_correction: float = 1.0
    last_now_s: float | None = None
    below_since_s: tuple[float | None, float | None] = (None, None)
    """(prefill, decode): since when the role's target has been below its active count."""


@dataclass(frozen=True)
class PredictiveDecision:
    decision: ScalingDecision
    memory: PredictiveMemory
    """Pass to the next `plan_predictive` call."""
    forecast: LoadForecast
    """The load the targets were set for."""
    lead_s: float
    targets: tuple[int, int]
    """(prefill, decode) workers the model asks for."""


def plan_predictive(
    tick: TickInput,
    config: PlannerConfig,
    predictive: PredictiveConfig,
    model: CapacityModel,
    memory: PredictiveMemory | None = None,
) -> PredictiveDecision:
    memory = memory or PredictiveMemory()
    interval = 0.0 if memory.last_now_s is None else max(tick.now_s - memory.last_now_s, 0.0)
    memory = _observe(tick, predictive, memory)
    now_load = LoadForecast(memory.arrival.level, memory.prompt.level, memory.output.level)
    memory = _correct(tick, config, predictive, model, memory, now_load)
    lead = predictive.startup_s + interval
    damping = predictive.trend_damping_s
    ahead = LoadForecast(
        max(memory.arrival.forecast(lead, damping), now_load.arrival_rps),
        max(memory.prompt.forecast(lead, damping), 1.0),
        max(memory.output.forecast(lead, damping), 1.0),
    )
    ticks_ahead = lead / interval if interval > 0 else 1.0
    headroom = predictive.headroom_z * memory.arrival.spread() * math.sqrt(ticks_ahead)
    margin = {Role.PREFILL: 0.0, Role.DECODE: headroom}
    guard = plan(tick, config, memory.reactive)
    reactive = memory.reactive
    decisions: dict[Role, RoleDecision] = {}
    targets: dict[Role, int] = {}
    below: list[float | None] = []
    for i, (role, guarded) in enumerate(
        ((Role.PREFILL, guard.prefill), (Role.DECODE, guard.decode))
    ):
        targets[role], why = _target(role, ahead, margin[role], config, predictive, model, memory)
        active = sum(1 for w in tick.workers(role) if not w.draining)
        since = memory.below_since_s[i] if targets[role] < active else None
        since = tick.now_s if since is None and targets[role] < active else since
        below.append(since)
        settled = role is Role.PREFILL or (
            since is not None and tick.now_s - since >= predictive.startup_s
        )
        decision = _decide(
            role, tick, config, predictive, reactive, guarded, targets[role], why, settled
        )
        if decision.changes:
            reactive = reactive.changed(role, tick.tick)
        decisions[role] = decision
    memory = replace(
        memory, reactive=reactive, last_now_s=tick.now_s, below_since_s=(below[0], below[1])
    )
    scaling = ScalingDecision(tick.tick, decisions[Role.PREFILL], decisions[Role.DECODE], reactive)
    return PredictiveDecision(
        scaling, memory, ahead, lead, (targets[Role.PREFILL], targets[Role.DECODE])
    )


def _observe(tick: TickInput, p: PredictiveConfig, memory: PredictiveMemory) -> PredictiveMemory:
    if memory.last_now_s is None:  # the first tick: no rate since a last one
        return memory
    arrival = memory.arrival.observe(tick.arrival_rps, tick.now_s, p.alpha, p.beta)
    prompt, output = memory.prompt, memory.output
    if tick.mean_prompt_tokens > 0:  # known while requests arrive
        prompt = prompt.observe(tick.mean_prompt_tokens, tick.now_s, p.alpha, p.beta)
    if tick.mean_output_tokens > 0:  # known once some finished
        output = output.observe(tick.mean_output_tokens, tick.now_s, p.alpha, p.beta)
    return replace(memory, arrival=arrival, prompt=prompt, output=output)


def _correct(
    tick: TickInput,
    config: PlannerConfig,
    p: PredictiveConfig,
    model: CapacityModel,
    memory: PredictiveMemory,
    load: LoadForecast,
) -> PredictiveMemory:
    """The corrections after this tick's samples (those since the last tick, warm ones only)
    against the model at the load now and the workers serving now."""
    since = memory.last_now_s
    corrections = {}
    for role in Role:
        workers = tick.workers(role)
        new = [s for s in tick.samples(role) if since is None or s.at_s > since]
        values = warm_samples(new, workers, tick.now_s, config.cold_start_s)
        old = memory.ttft_correction if role is Role.PREFILL else memory.tpot_correction
        serving = sum(1 for w in workers if w.ready and not w.draining)
        predicted = _latency_s(role, model, load, serving)
        backlog = role is Role.PREFILL and (
            tick.queue_depth > config.max_queue_per_prefill_worker * max(serving, 1)
        )
        if (len(values) < config.min_samples or not 0 < predicted < math.inf or backlog
                or not _holds(role, model, load, serving, p)):  # fmt: skip
            corrections[role] = old  # a backlog's latency is no measure of the model's error
            continue
        observed = percentile(values, config.slo_percentile)
        ratio = observed / 1000.0 / predicted
        ratio = min(max(ratio, p.min_correction), p.max_correction)
        corrections[role] = p.correction_alpha * ratio + (1 - p.correction_alpha) * old
    return replace(
        memory, ttft_correction=corrections[Role.PREFILL], tpot_correction=corrections[Role.DECODE]
    )


def _holds(
    role: Role,
    model: CapacityModel,
    load: LoadForecast,
    workers: int,
    p: PredictiveConfig,
    margin_rps: float = 0.0,
) -> bool:
    """`workers` of `role` keep up with `load` (prefill: within `max_utilization`, and back
    from a step of `burst_prompts` prompts; decode: not saturated at `margin_rps` more)."""
    if role is Role.DECODE:
        over = replace(load, arrival_rps=load.arrival_rps + margin_rps)
        return not math.isinf(model.decode_streams(over, workers))
    burst = p.burst_prompts * load.mean_prompt_tokens
    return model.prefill_utilization(load, workers) <= p.max_utilization and model.recovers(
        load, workers, burst
    )


def _latency_s(role: Role, model: CapacityModel, load: LoadForecast, workers: int) -> float:
    return model.ttft_s(load, workers) if role is Role.PREFILL else model.tpot_s(load, workers)


def _target(
    role: Role,
    load: LoadForecast,
    margin_rps: float,
    config: PlannerConfig,
    p: PredictiveConfig,
    model: CapacityModel,
    memory: PredictiveMemory,
) -> tuple[int, str]:
    """The fewest workers of `role` within its bounds that hold the corrected latency within
    `target_ratio` of the SLO at `load` and keep up with `margin_rps` more (its bound's
    maximum when none does), and why."""
    bounds = config.bounds(role)
    correction = memory.ttft_correction if role is Role.PREFILL else memory.tpot_correction
    budget_s = config.slo_ms(role) / 1000.0 * p.target_ratio
    metric = "TTFT" if role is Role.PREFILL else "TPOT"
    n = max(bounds.min_workers, 1 if load.arrival_rps > 0 else 0)
    while n < bounds.max_workers:
        fits = _latency_s(role, model, load, n) * correction <= budget_s
        if fits and _holds(role, model, load, n, p, margin_rps):
            break
        n += 1
    n = min(n, bounds.max_workers)
    predicted = _latency_s(role, model, load, n) * correction * 1000.0
    extra = f" + {margin_rps:.1f} margin" if margin_rps > 0 else ""
    why = (
        f"forecast {load.arrival_rps:.1f}{extra} req/s (prompt {load.mean_prompt_tokens:.0f}, "
        f"output {load.mean_output_tokens:.0f} tok): target {n}, {metric} {predicted:.0f} ms "
        f"(x{correction:.2f})"
    )
    return n, why


def _decide(
    role: Role,
    tick: TickInput,
    config: PlannerConfig,
    p: PredictiveConfig,
    memory: PlannerMemory,
    guard: RoleDecision,
    target: int,
    why: str,
    settled: bool,
) -> RoleDecision:
    """`settled`: the target has stayed below the active count for a start-up."""
    active = [w for w in tick.workers(role) if not w.draining]
    n = len(active)
    room = config.bounds(role).max_workers - n
    stops = list(guard.reasons[: len(guard.stop)])  # `plan` gives the stops' reasons first
    reasons = [*stops, why]
    if guard.add > 0 or target > n:
        add = min(max(guard.add, target - n), max(room, 0))
        if guard.add > 0:
            reasons.append("guard: " + "; ".join(guard.reasons[len(stops) :]))
        return RoleDecision(role, add=add, stop=guard.stop, reasons=tuple(reasons))
    if target < n:
        last = memory.last_change(role)
        if last is not None and tick.tick - last < config.cooldown_ticks:
            reasons.append(f"cooldown: changed at tick {last}")
        elif not settled:
            reasons.append("hold: the target below the count for less than a start-up")
        else:
            drain = pick_drain(active, min(n - target, p.drain_step))
            return RoleDecision(role, drain=drain, stop=guard.stop, reasons=tuple(reasons))
    return RoleDecision(role, stop=guard.stop, reasons=tuple(reasons))


class PredictivePlanner:
    """The predictive core with its memory threaded through (as `planner.core.Planner`)."""

    def __init__(
        self, config: PlannerConfig, predictive: PredictiveConfig, profile: PerfProfile
    ) -> None:
        self.config = config
        self.predictive = predictive
        self.model = CapacityModel(profile)
        self.memory = PredictiveMemory()
        self.last: PredictiveDecision | None = None

    def tick(self, tick: TickInput) -> ScalingDecision:
        result = plan_predictive(tick, self.config, self.predictive, self.model, self.memory)
        self.memory = result.memory
        self.last = result
        log.info("planner %s", result.decision.describe())
        return result.decision

    def apply(self, decision: ScalingDecision, actuator: ScalingActuator) -> None:
        apply_decision(decision, actuator)
