"""What the router's admin service asks of the control plane, and the values it gets back.

The controller actor (deploy/controller.py) implements `ClusterControl`; the admin servicer
(router/servicer.py) calls it through `router.server.ControllerControl`. Kept here, free of
grpc and Ray, so both sides import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DrainRefused(Exception):
    """A drain, undrain or rebalance that cannot be done as asked (unknown worker, a bad
    timeout, the last ready worker of a role without force, no room for new workers);
    nothing was changed."""


@dataclass(frozen=True)
class DrainReport:
    """What a drain did."""

    drained: bool
    """Every request the worker held finished within the timeout."""
    message: str
    requests_at_start: int
    requests_cut: int
    """Requests still running at the timeout that stopping the worker ended."""
    stopped: bool


class ClusterControl(Protocol):
    """The control plane as the admin service sees it; each call raises `DrainRefused`
    (possibly wrapped by Ray) for what cannot be done as asked."""

    async def drain(
        self, worker_id: str, stop: bool, timeout_s: float, force: bool
    ) -> DrainReport: ...

    async def undrain(self, worker_id: str) -> str: ...

    async def rebalance(
        self, prefill: int, decode: int, timeout_s: float
    ) -> tuple[list[str], list[str], str]: ...
