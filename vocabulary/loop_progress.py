"""How a worker thread's loop is getting on: its state and progress, read from any thread.

The engine's thread (engine/core/driver.py) and the KV-transfer loops
(kv_transfer/agent_loop.py) report it; health checks (worker_runtime) read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LoopState(enum.Enum):
    """Where a worker thread's loop is: NEW → RUNNING → STOPPED (asked to stop), or
    RUNNING → DIED (the loop raised out of its thread; nothing serves its work any more)."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"
    DIED = "died"


@dataclass(frozen=True)
class LoopProgress:
    """How a worker thread's loop is getting on, taken from any thread (it reads plain
    attributes the loop writes and never touches what the loop owns).

    A healthy loop completes an iteration at least once per idle wait, so `stalled_s` stays
    small unless one iteration (a step, a command, a tick) is taking long; with `has_work` it
    is the time that work has been waiting at most. Values may lag the loop by an iteration.
    """

    state: LoopState
    has_work: bool
    """Something is queued or under way: commands, unfinished requests, owner-reported work."""
    stalled_s: float
    """Seconds since the loop last completed an iteration (since it started, before that)."""
    error: str = ""
    """Why the thread ended, when `state` is DIED."""
