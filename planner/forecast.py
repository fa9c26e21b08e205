"""The predictive planner's load forecast: Holt's double exponential smoothing, over time.

Each series (the arrival rate, the mean prompt and output lengths) keeps a level and a trend
per second. An observation `x` taken `dt` seconds after the last one updates them as

    level' = alpha * x + (1 - alpha) * (level + trend * dt)
    trend' = beta * (level' - level) / dt + (1 - beta) * trend

and the forecast `h` seconds ahead is `level + trend * h` (never below 0). The first
observation sets the level, with no trend. Each later one also updates the residual spread, the
smoothed square of the error of the forecast it was taken against (`x - (level + trend * dt)`,
weighted `alpha` as the level is): the forecast's own measure of how far off it runs. A damped
forecast (`damping_s`) lets the trend fade with the horizon (Gardner and McKenzie's damped
trend, in continuous time, applied to the forecast only): a trend is trusted near at hand, and
a step in the series, which Holt reads as a steep trend, is not carried far.
Pure: frozen states in, frozen states out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HoltState:
    """One series' smoothed level and trend (per second), and when it was last observed."""

    level: float = 0.0
    trend: float = 0.0
    at_s: float | None = None
    """When the last observation was taken (None: never)."""
    residual_var: float = 0.0
    """Smoothed squared one-observation-ahead forecast error."""

    def observe(self, value: float, at_s: float, alpha: float, beta: float) -> HoltState:
        """The state after observing `value` at `at_s` (an observation not after the last
        one only moves the level)."""
        if self.at_s is None:
            return HoltState(value, 0.0, at_s)
        dt = at_s - self.at_s
        if dt <= 0:
            level = alpha * value + (1 - alpha) * self.level
            return HoltState(level, self.trend, self.at_s, self.residual_var)
        expected = self.level + self.trend * dt
        level = alpha * value + (1 - alpha) * expected
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend
        var = alpha * (value - expected) ** 2 + (1 - alpha) * self.residual_var
        return HoltState(level, trend, at_s, var)

    def forecast(self, ahead_s: float, damping_s: float = math.inf) -> float:
        """The value `ahead_s` seconds after the last observation (>= 0); with `damping_s`, a
        damped trend: `level + trend * damping_s * (1 - exp(-ahead_s / damping_s))`, the
        trend counting in full at first and fading past about `damping_s`."""
        reach = ahead_s if math.isinf(damping_s) else damping_s * -math.expm1(-ahead_s / damping_s)
        return max(0.0, self.level + self.trend * reach)

    def spread(self) -> float:
        """The residual spread: the root of `residual_var`, in the series' units."""
        return self.residual_var**0.5


@dataclass(frozen=True)
class LoadForecast:
    """The load the predictive planner sizes the cluster for."""

    arrival_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
