"""What the router's admin service asks of the control plane, and the values it gets back.

The controller actor (deploy/control/cluster_controller.py) implements `ClusterControl`; the admin
servicer (router/servicer.py) calls it through `router.router_server.ControllerControl`. Kept here,
free of grpc and Ray, so both sides import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vocabulary.worker_api import RoleSwitch


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


@dataclass(frozen=True)
class RebalanceReport:
    """What a rebalance did."""

    started: tuple[str, ...]
    stopped: tuple[str, ...]
    switched: tuple[str, ...]
    """Workers that changed role in place (drained, flipped, admitting as the other role: no
    restart, no model load)."""
    message: str


class LoraRefused(Exception):
    """A LoRA load or unload that cannot be done as asked (an adapter a worker cannot serve,
    LoRA off, an unknown name); `not_found` for an unload of a name nobody has. Nothing was
    changed: a load that failed on one worker is undone on the others."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


@dataclass(frozen=True)
class LoraEntry:
    """One adapter the cluster serves, as `pdserve lora list` shows it."""

    name: str
    path: str
    rank: int
    workers: tuple[str, ...]
    """Workers that have it registered."""
    loaded_on: tuple[str, ...]
    """Of those, the ones whose adapter cache holds its weights (device or host memory)."""


class ClusterControl(Protocol):
    """The control plane as the admin service sees it; each call raises `DrainRefused`
    (`switch`: `RoleSwitchRefused`), possibly wrapped by Ray, for what cannot be done as
    asked."""

    async def drain(
        self, worker_id: str, stop: bool, timeout_s: float, force: bool
    ) -> DrainReport: ...

    async def undrain(self, worker_id: str) -> str: ...

    async def rebalance(
        self, prefill: int, decode: int, timeout_s: float, restart: bool = False
    ) -> RebalanceReport: ...

    async def switch(
        self, worker_id: str, role: str, timeout_s: float, force: bool = False
    ) -> RoleSwitch: ...

    async def load_lora(self, name: str, path: str) -> list[LoraEntry]: ...

    async def unload_lora(self, name: str) -> list[LoraEntry]: ...

    async def list_loras(self) -> list[LoraEntry]: ...
