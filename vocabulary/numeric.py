"""Integer and order arithmetic every package shares: block counts and percentiles."""

from __future__ import annotations

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
