"""How many SMs a split engine's decode loop gets: the fewest whose predicted step time meets
its TPOT target at the current batch and context, the rest to prefill; every SM to one side
when the other has nothing to do. Pure and torch-free, so it is tested exhaustively and the
simulator's split worker (simulator/split.py) decides with the engine's own code
(engine/core/prefill_lane.py).

A decode step streams the weights and the batch's KV once, so its time is bytes over the
bandwidth its SMs can draw (`BandwidthCurve`: measured per SM share by `python -m benchmarks
sm_partition`, or the default shape below) plus a fixed launch cost, times the slowdown the
decode steps are measured to suffer while a prefill runs beside them (`StepCorrection`: the
curve is measured alone, and a prefill's matmuls draw on the same HBM; an H100 measured
1923 GB/s for a 32-SM decode partition alone and 1388 GB/s beside a 100-SM prefill). The
split changes no
more often than `min_interval_s` (`SplitGovernor`), and only among the shares the engine made
partitions (and CUDA graphs) for.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthCurve:
    """HBM bytes/s a decode step draws with a given number of SMs (linear in between)."""

    points: tuple[tuple[int, float], ...]
    """(SMs, bytes/s), increasing in SMs."""

    def __post_init__(self) -> None:
        if not self.points or any(
            b <= a for (a, _), (b, _) in zip(self.points, self.points[1:], strict=False)
        ):
            raise ValueError("BandwidthCurve.points: increasing SM counts, at least one")

    def at(self, sms: int) -> float:
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, sms)
        if i == 0:
            return self.points[0][1] * sms / self.points[0][0]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (sms - x0) / (x1 - x0)

    @classmethod
    def saturating(cls, total_sms: int, peak_bytes_s: float, knee: float = 0.45) -> BandwidthCurve:
        """A curve that rises linearly to `peak_bytes_s` at `knee` of the SMs and stays there
        (the shape HBM bandwidth has against SM count on Hopper)."""
        at_knee = max(1, round(total_sms * knee))
        return cls(((at_knee, peak_bytes_s), (total_sms, peak_bytes_s)))


@dataclass(frozen=True)
class DecodeLoad:
    """What the decode loop's next steps read: how many requests, and their KV bytes."""

    running: int
    kv_bytes: int
    prefill_waiting: bool
    """The prefill loop has work (queued or in flight)."""


@dataclass(frozen=True)
class SplitModel:
    """Predicted decode step time from the bytes a step streams."""

    weight_bytes: int
    curve: BandwidthCurve
    launch_s: float = 0.3e-3
    """Host and launch cost of a step that bandwidth does not explain."""
    slowdown: float = 1.0
    """Measured step time over predicted while a prefill runs beside (`StepCorrection`)."""

    def step_s(self, load: DecodeLoad, sms: int) -> float:
        alone = self.launch_s + (self.weight_bytes + load.kv_bytes) / self.curve.at(sms)
        return alone * self.slowdown


class StepCorrection:
    """The decode steps' slowdown beside a prefill: an exponential average of measured over
    predicted (slowdown 1) step time, over the steps that ran while the prefill loop had work,
    kept within [`low`, `high`] so one stalled step (a host hiccup) cannot swing the split."""

    def __init__(self, weight: float = 0.1, low: float = 0.5, high: float = 4.0) -> None:
        if not 0 < weight <= 1 or not 0 < low <= 1 <= high:
            raise ValueError("StepCorrection: 0 < weight <= 1 and 0 < low <= 1 <= high")
        self.weight, self.low, self.high = weight, low, high
        self.factor = 1.0
        self.samples = 0

    def observe(self, measured_s: float, predicted_s: float) -> None:
        if measured_s <= 0 or predicted_s <= 0:
            return
        ratio = min(self.high, max(self.low, measured_s / predicted_s))
        self.factor += self.weight * (ratio - self.factor)
        self.samples += 1


def choose_decode_sms(
    load: DecodeLoad, shares: Sequence[int], total_sms: int, model: SplitModel, tpot_s: float
) -> int:
    """The decode loop's SMs for `load`: all of them when the prefill loop is idle, the
    smallest share when nothing decodes, else the smallest share whose step meets `tpot_s`
    (the largest when none does)."""
    if not load.prefill_waiting:
        return total_sms
    ordered = sorted(shares)
    if load.running == 0:
        return ordered[0]
    for sms in ordered:
        if model.step_s(load, sms) <= tpot_s:
            return sms
    return ordered[-1]


class SplitGovernor:
    """Applies `choose_decode_sms`, changing the split at most once per `min_interval_s`."""

    def __init__(self, min_interval_s: float) -> None:
        self.min_interval_s = min_interval_s
        self._changed_at = float("-inf")
        self.current: int | None = None

    def decide(self, wanted: int, now_s: float) -> int | None:
        """The new split when it changes now; None to keep the current one."""
        if wanted == self.current:
            return None
        if self.current is not None and now_s - self._changed_at < self.min_interval_s:
            return None
        self.current, self._changed_at = wanted, now_s
        return wanted


def decode_shares(total_sms: int) -> tuple[int, ...]:
    """The decode partitions an adaptive split chooses among: an eighth, a quarter, a third,
    half and two thirds of the device, in whole groups of 8 SMs (the granularity Hopper's
    driver splits SMs in)."""
    shares = {max(8, round(total_sms * f / 8) * 8) for f in (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3)}
    return tuple(sorted(s for s in shares if s < total_sms))
