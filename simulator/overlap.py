"""Steps that share one device: two loops whose steps overlap in time run slower than alone.

Two cases use it (simulator/cluster.py):

- a split worker's prefill and decode loops, each on its own SM partition of one GPU
  (simulator/split.py): the partitions divide the SMs, not the memory system, so a step
  that runs while the other loop's step runs is slower by that loop's measured factor;
- a prefill worker and a decode worker sharing one GPU (`ClusterShape.shared_device`): two
  processes time-slice the device, so each runs slower while the other computes.

A lane's step is work measured in seconds alone; while another lane of its device is busy
the step advances at 1 / `slowdown` of that rate (processor sharing: when the other lane
starts or ends a step, every busy lane's remaining work is brought up to date and its end
moved). A step's end event that was moved is stale and does nothing (its token is old).
"""

from __future__ import annotations

import functools
from collections.abc import Callable


class Lane:
    """One loop's steps on a shared device (states: idle → busy → idle)."""

    def __init__(self, name: str, slowdown: float) -> None:
        if not slowdown >= 1.0:
            raise ValueError(
                f"{name}: a slowdown beside the other loop must be >= 1, got {slowdown}"
            )
        self.name = name
        self.slowdown = slowdown
        """Step time over alone while another lane of the device is busy."""
        self.busy = False
        self.work_s = 0.0
        """The step's remaining work, seconds at the rate alone."""
        self.rate = 1.0
        self.since_s = 0.0
        self.started_s = 0.0
        self.token = 0
        self.beside = False
        """Some of the step in flight ran beside another lane's step."""
        self.device: SharedDevice | None = None
        """The device it runs on (set by `SharedDevice`)."""
        self._done: Callable[[], None] | None = None


class SharedDevice:
    """The lanes of one device and the end events of their steps."""

    def __init__(
        self,
        lanes: tuple[Lane, ...],
        at: Callable[[float, Callable[[], None]], None],
        clock: Callable[[], float],
    ) -> None:
        self.lanes = lanes
        self._at = at
        self._clock = clock
        self.busy_s = 0.0
        """Time some lane of the device had a step in flight."""
        self._since_s = 0.0
        for lane in lanes:
            lane.device = self

    def start(self, lane: Lane, work_s: float, done: Callable[[], None]) -> None:
        """`lane` starts a step of `work_s` seconds alone; `done()` runs when it ends."""
        if lane.busy:
            raise RuntimeError(f"{lane.name}: a step is already in flight")
        now = self._clock()
        self._advance(now)
        lane.busy, lane.work_s, lane.since_s, lane.started_s = True, work_s, now, now
        lane.rate, lane.beside, lane._done = 0.0, False, done  # rate 0: scheduled below
        self._reschedule(now)

    def _advance(self, now: float) -> None:
        if any(lane.busy for lane in self.lanes):
            self.busy_s += now - self._since_s
        self._since_s = now
        for lane in self.lanes:
            if lane.busy:
                lane.work_s = max(0.0, lane.work_s - (now - lane.since_s) * lane.rate)
                lane.since_s = now

    def _reschedule(self, now: float) -> None:
        busy = [lane for lane in self.lanes if lane.busy]
        for lane in busy:
            rate = 1.0 / lane.slowdown if len(busy) > 1 else 1.0
            lane.beside = lane.beside or len(busy) > 1
            if rate == lane.rate:
                continue
            lane.rate = rate
            lane.token += 1
            end = now + lane.work_s / rate
            self._at(end, functools.partial(self._finish, lane, lane.token))

    def _finish(self, lane: Lane, token: int) -> None:
        if token != lane.token or not lane.busy:
            return  # moved since
        now = self._clock()
        self._advance(now)
        lane.busy, lane.work_s = False, 0.0
        lane.rate = 0.0
        done, lane._done = lane._done, None
        self._reschedule(now)
        assert done is not None
        done()
