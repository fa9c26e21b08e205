"""One pdserve cluster at a time on the test session's Ray (the `cluster_slot` fixture)."""

from __future__ import annotations

from collections.abc import Callable


class ClusterSlot:
    """The session's Ray holds one pdserve cluster at a time: its controller and routers have
    fixed names, and `Cluster.start` refuses to start beside a running controller. A fixture
    that keeps a cluster for the session (router, security) holds the slot; the next fixture
    to take it stops the cluster before (tests run directory by directory, so the earlier
    one's tests are done; `Cluster.stop` is idempotent, its own teardown still runs)."""

    def __init__(self) -> None:
        self._stop: Callable[[], None] | None = None

    def take(self, stop: Callable[[], None]) -> None:
        """Stop the cluster that holds the slot, if any; `stop` stops the caller's."""
        if self._stop is not None:
            self._stop()
        self._stop = stop

    def release(self, stop: Callable[[], None]) -> None:
        if self._stop is stop:
            self._stop = None
