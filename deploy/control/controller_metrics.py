"""The controller's Prometheus series: the worker registry, worker lifecycle and the planner.

The controller actor serves them on a port of its own (a free one, on its node's address:
loopback on a local Ray); `Controller.metrics_url()` says where, and `scripts/observe.sh`
asks it. What the routers export is per request and per worker load; this is what only the
controller knows: which workers exist in which state and since when, which answer its
health pings, which it removed and why, and what the planner decided (planner/metrics.py).
The registry's state is read at scrape time (`RegistryCollector`), so the series cannot
drift from the registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from planner.metrics import PlannerMetrics
from vocabulary.worker_api import WorkerRole, WorkerState

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)

STATES = (WorkerState.STARTING, WorkerState.READY, WorkerState.DRAINING, WorkerState.DRAINED)
"""States a registered worker is in (STOPPED and dead workers leave the registry)."""
REMOVAL_REASONS = ("stopped", "dead", "unhealthy", "start_failed")


class RegisteredWorker(Protocol):
    """What the collector reads of a registry entry (deploy/control/worker_registry.py
    `Registered`)."""

    worker_id: str
    role: WorkerRole
    state: WorkerState
    state_since: float
    """`time.monotonic()` when it entered `state`."""
    failures: int
    """Health pings missed in a row (0: its last one answered)."""


class RegistryCollector:
    """Renders the registry. `entries()` runs on the metrics server's thread: it must return a
    copy of the controller's live list (its entries may change under the read: harmless)."""

    def __init__(
        self, entries: Callable[[], Iterable[RegisteredWorker]], roles: Iterable[str]
    ) -> None:
        self._entries = entries
        self._roles = tuple(roles)

    def collect(self) -> Iterator[Metric]:
        entries = sorted(self._entries(), key=lambda e: e.worker_id)
        now = time.monotonic()
        counts = GaugeMetricFamily(
            "pdserve_controller_workers", "Registered workers by role and state",
            labels=["role", "state"],
        )  # fmt: skip
        roles = sorted({*self._roles, *(e.role.value for e in entries)})
        for role in roles:
            for st in STATES:
                n = sum(e.role.value == role and e.state is st for e in entries)
                counts.add_metric([role, st.value], n)
        labels = ["worker", "role"]
        state = GaugeMetricFamily(
            "pdserve_controller_worker_state", "Each worker's state (1 for the current one)",
            labels=[*labels, "state"],
        )  # fmt: skip
        since = GaugeMetricFamily(
            "pdserve_controller_worker_state_seconds", "Seconds each worker has been in its state",
            labels=labels,
        )  # fmt: skip
        draining = GaugeMetricFamily(
            "pdserve_controller_worker_draining_seconds",
            "Seconds each worker has been draining (0 unless draining)",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "pdserve_controller_worker_up",
            "The worker answered its last health ping (1), or missed it (0)",
            labels=labels,
        )
        for e in entries:
            ids = [e.worker_id, e.role.value]
            for s in STATES:
                state.add_metric([*ids, s.value], float(e.state is s))
            since.add_metric(ids, now - e.state_since)
            draining.add_metric(ids, now - e.state_since if e.state is WorkerState.DRAINING else 0)
            up.add_metric(ids, float(e.failures == 0))
        yield from (counts, state, since, draining, up)

    def describe(self) -> list[Metric]:
        return []


class ControllerMetrics:
    """The controller's registry, its lifecycle counters and the planner's series."""

    def __init__(
        self, entries: Callable[[], Iterable[RegisteredWorker]], roles: Iterable[str]
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        roles = tuple(roles)
        r.register(RegistryCollector(entries, roles))
        self.started = Counter(
            "pdserve_controller_workers_started", "Workers that became ready", ["role"],
            registry=r,
        )  # fmt: skip
        self.removed = Counter(
            "pdserve_controller_workers_removed",
            "Workers removed from the registry, by why (stopped: drained or asked to; dead: "
            "stopped answering; unhealthy: reported its engine or a loop broken; start_failed)",
            ["role", "reason"],
            registry=r,
        )
        self.switches = Counter(
            "pdserve_controller_role_switches",
            "Role switches of a worker in place (no restart), by roles and whether it switched "
            "(false: its requests outlasted the drain timeout; it stayed in its old role)",
            ["from_role", "to_role", "switched"],
            registry=r,
        )
        for role in roles:
            self.started.labels(role)
            for reason in REMOVAL_REASONS:
                self.removed.labels(role, reason)
        self.planner = PlannerMetrics(r)
        self._server: WSGIServer | None = None
        self.url = ""

    def serve(self, host: str, port: int = 0) -> str:
        """Start the HTTP server (port 0: a free one); returns its /metrics URL, or "" when
        it could not bind (logged: the cluster runs on without controller metrics)."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            log.warning("controller metrics not served on %s:%s: %s", host, port, e)
            return ""
        self._server = server
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{server.server_port}/metrics"
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
