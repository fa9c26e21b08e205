"""Aborts that came before their call, remembered so that the call ends when it comes.

Ray does not run an async actor's calls in their caller's order (a later call may run while
an earlier one still waits, and a `ray.cancel` that reached the worker before the call it
cancels is retried only later). The router's "give up on the call, then
`abort.remote(request_id)`" can therefore run on a worker before the call itself: the abort
finds nothing, and the call that follows would hold blocks for a caller that is gone (a
prefill worker's lease until it expires, a decode worker's request until `max_tokens`). A
worker's `abort` that finds no call remembers the id here; the call takes it on arrival and
ends at once. Worker-facing request ids are never reused on a worker, so remembering the id of
a call that already ended is harmless.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

EARLY_ABORT_MEMORY_S = 60.0
"""How long an abort that found no call is remembered: far longer than Ray takes to deliver a
call sent before the abort, and than the 2 s after which Ray retries a `ray.cancel` that
reached the worker before the call it cancels."""


class EarlyAborts:
    """Request ids whose abort found no call on this worker, each kept `memory_s` (see the
    module docstring). Not thread-safe: the actor's event loop owns it."""

    def __init__(
        self,
        memory_s: float = EARLY_ABORT_MEMORY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._memory_s = memory_s
        self._clock = clock
        self._at: OrderedDict[str, float] = OrderedDict()  # request id → when, oldest first

    def __len__(self) -> int:
        return len(self._at)

    def remember(self, request_id: str) -> None:
        """An abort of `request_id` found no call here (it ended, or has not come yet)."""
        now = self._clock()
        self._at[request_id] = now
        self._at.move_to_end(request_id)
        while self._at:
            oldest, at = next(iter(self._at.items()))
            if now - at < self._memory_s:
                break
            del self._at[oldest]

    def take(self, request_id: str) -> bool:
        """True (once) if `request_id` was aborted within `memory_s` before its call came."""
        at = self._at.pop(request_id, None)
        return at is not None and self._clock() - at < self._memory_s
