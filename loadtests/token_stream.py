"""A workload's token ids: the draws of a string-seeded `random.Random`, made in bulk.

`TokenStream(seed, low, high)` yields exactly what `low + int(rng.random() * (high - low))`
would, one draw per token, for `rng = random.Random(seed)`: numpy's MT19937 takes over the
Mersenne Twister's state (`Random.getstate`) and its doubles are built from two 32-bit outputs
as CPython's `random()` builds them (53 bits), so the ids are the same bit for bit, drawn in
blocks rather than one Python call each (a prompt of ~300 tokens: ~50 µs the Python way).
`skip(n)` moves past n draws without making them into ids (a request another shard of a
sharded simulation serves, `loadtests/workload.py:stream`).
"""

from __future__ import annotations

import random

import numpy as np

BLOCK = 1 << 16
"""Doubles drawn at once."""


class TokenStream:
    """Token ids in [low, high), in the order `random.Random(seed)` would draw them."""

    def __init__(self, seed: str, low: int, high: int) -> None:
        _, state, _ = random.Random(seed).getstate()
        self._bits = np.random.MT19937()
        self._bits.state = {
            "bit_generator": "MT19937",
            "state": {"key": np.array(state[:624], dtype=np.uint32), "pos": state[624]},
        }
        self._generator = np.random.Generator(self._bits)
        self._low, self._span = low, high - low
        self._block = np.empty(BLOCK)
        self._ids = np.empty(0, dtype=np.int64)
        self._at = 0
        """Next unused id in `_ids`."""

    def take(self, n: int) -> tuple[int, ...]:
        """The next `n` ids."""
        if self._at + n <= len(self._ids):
            start, self._at = self._at, self._at + n
            return tuple(self._ids[start : self._at].tolist())
        rest = self._ids[self._at :].tolist()
        self._at = len(self._ids)
        need = n - len(rest)
        if need > BLOCK:  # longer than a block: drawn on its own, the block left empty
            return tuple(rest + self._draw(need).tolist())
        self._ids = self._draw(BLOCK)
        self._at = need
        return tuple(rest + self._ids[:need].tolist())

    def skip(self, n: int) -> None:
        """Move past the next `n` draws."""
        left = len(self._ids) - self._at
        if n <= left:
            self._at += n
            return
        self._at = len(self._ids)
        n -= left
        while n > 0:  # drawn into one buffer: cheaper than advancing the generator raw
            k = min(n, BLOCK)
            self._generator.random(out=self._block[:k])
            n -= k

    def _draw(self, n: int) -> np.ndarray:
        # `int(x * span)` truncates as the cast does (x * span >= 0)
        return self._low + (self._generator.random(n) * self._span).astype(np.int64)
