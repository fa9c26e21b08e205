"""Integer and order arithmetic every package shares: block counts, percentiles and the
piecewise-linear lookups of measured step times."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b in integers: the number of blocks of b tokens that hold a tokens."""
    return -(-a // b)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extended along the end segments,
    floored at the smallest y (a measured time never extrapolates below the fastest one)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, min(ys))


def interpolate_2d(
    outer: Sequence[float], rows: Sequence[tuple[Sequence[float], Sequence[float]]],
    x_outer: float, x_inner: float,
) -> float:  # fmt: skip
    """A grid lookup: each row (inner xs, ys) at `x_inner`, then across the rows (one per
    `outer` x, ascending) at `x_outer`, both as `interpolate`."""
    return interpolate(outer, [interpolate(xs, ys, x_inner) for xs, ys in rows], x_outer)
