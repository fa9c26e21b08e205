"""The controller actor: the worker registry, health checks, drain and rebalance.

A named, detached Ray actor (`pdserve-controller`). It creates the workers, tells routers who
exists (`list_workers`), pings every worker on a timer and removes a dead one from the
registry within seconds (replacing it when `replace_dead`), and moves capacity between roles
by draining: a worker leaving a role first stops admitting, finishes its in-flight requests
and leases, and only then stops, so a rebalance loses no request; or, drained the same way,
it switches role in place (deploy/control/role_switch.py: the same actor and engine serve the
new role). With `spec.planner.enabled` it also runs the planner loop (planner/loop.py), which
scales each role and asks Ray's autoscaler for nodes. Being detached, it outlives the driver
that made it: `Cluster.stop` (and so `pdserve down`) kills it, which also ends the workers it
owns.

Worker states as the controller sees them:

    STARTING ──start() ok──► READY ──drain()──► DRAINING ──idle, stop──► STOPPED (removed)
       │                     ▲  │                 │  │
       └── start failed      │  │                 │  └─ idle, no stop ──► DRAINED
           (removed)         │  │                 └─ timeout, stop: cut ──► STOPPED
                             └──┴──── undrain() ◄── DRAINING / DRAINED
    READY / DRAINING / DRAINED ── ping fails `failure_threshold` times, or the worker
                                  reports itself unhealthy ──► DEAD (removed, replaced if set)

Routers see READY, DRAINING and DRAINED workers (`list_workers`): a draining worker's streams
go on over the router's token channel until they finish; placement sends it nothing new.
A removed worker's entries are purged from the Redis prefix index at once (and, at start,
those of every worker the registry does not hold), so routing never counts on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, cast

import ray

from deploy.control import lora_admin, rebalance, role_switch
from deploy.control.cluster_spec import ClusterSpec
from deploy.control.controller_metrics import ControllerMetrics
from deploy.control.worker_actors import create_worker, stop_worker
from deploy.control.worker_registry import (
    LISTED_STATES,
    Registered,
    listed,
    signature,
)
from planner.loop import (
    PlannerLoop,
    ResourceRequester,
    WorkerSnapshot,
    planner_role,
)
from prefix_index.index import PrefixIndex
from router.cluster_view import RegistrySignature, WorkerListing
from router.control import DrainReport, LoraEntry, RebalanceReport
from router.router_server import RouterSignals
from vocabulary.malloc_trim import start_malloc_trim
from vocabulary.waits import wait_within
from vocabulary.worker_api import (
    ACTOR_NAME_PREFIX,
    ActorPlacement,
    RoleSwitch,
    WorkerInfo,
    WorkerRole,
    WorkerState,
    WorkerUnhealthy,
)
from worker_runtime.runtime import WorkerConfig

log = logging.getLogger(__name__)

CONTROLLER_NAME = "pdserve-controller"
ROUTER_PREFIX = "pdserve-router-"
"""Router replica i is the actor `pdserve-router-{i}` of the cluster's namespace."""
ADOPT_TIMEOUT_S = 10.0
"""How long a restarted controller waits for each worker it finds to say who it is."""


class Controller:
    """Ray actor class (create with `ray.remote(Controller).options(name=..., lifetime=...)`)."""

    def __init__(self, spec: ClusterSpec) -> None:
        start_malloc_trim("controller")  # from PDSERVE_MALLOC_TRIM_S (cluster.malloc_trim_s)
        self.spec = spec
        self.workers: dict[str, Registered] = {}
        self._ids = itertools.count()
        self._health_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self._lora_lock = asyncio.Lock()
        self._event_seq = itertools.count()
        self.events: deque[tuple[int, str]] = deque(maxlen=1000)
        self.routers: list[Any] = []
        self.planner: PlannerLoop | None = None
        self._planner_task: asyncio.Task[None] | None = None
        self._prefix_index: PrefixIndex | None = None
        roles = (WorkerRole.PREFILL, spec.decode_role, WorkerRole.SPLIT)
        self._roles = tuple(dict.fromkeys(r.value for r in roles))
        """The roles of this controller's workers (ids are `<role>-<n>`)."""
        self.metrics = ControllerMetrics(lambda: list(self.workers.values()), self._roles)
        if ray.is_initialized():  # an actor (not a unit test's bare instance)
            self.metrics.serve(ray.util.get_node_ip_address())
        _log_to_stderr()
        if _restarted_actor():
            self._adopt()

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> list[WorkerInfo]:
        """Start the configured workers (all at once); returns their infos."""
        infos = await asyncio.gather(*(self._start_worker(r) for r in self.spec.initial_roles()))
        await self._purge_index()  # entries of workers an earlier cluster left behind
        self._start_loops()
        return list(infos)

    def _start_loops(self) -> None:
        """The health check, and the planner when it is on."""
        self._health_task = asyncio.get_event_loop().create_task(self._health_loop())
        if self.spec.planner.enabled:
            settings = self.spec.planner
            resources = ResourceRequester() if settings.request_resources else None
            self.planner = PlannerLoop(
                settings, self, self.spec.decode_role, resources, metrics=self.metrics.planner
            )
            self._planner_task = asyncio.create_task(self.planner.run())
            c = self.planner.settings.config
            self._log(
                f"planner on ({settings.mode_text}): every {settings.interval_s:g}s; SLO "
                f"p{c.slo_percentile:g} TTFT "
                f"{c.ttft_slo_ms:g} ms, TPOT {c.tpot_slo_ms:g} ms; prefill "
                f"{c.prefill.min_workers}..{c.prefill.max_workers}, decode "
                f"{c.decode.min_workers}..{c.decode.max_workers}"
            )

    def _adopt(self) -> None:
        """After a restart (the actor died and Ray made it again from the same spec): take
        back the workers and routers that outlived it (workers are detached actors), so none
        is orphaned, and check them again. A worker that cannot say who it is (it was still
        starting) is killed and replaced. Only ids as this controller gives them out
        (`<role>-<n>`, its roles) are its own: a worker actor some other code started in the
        namespace is left alone (adopted, the cluster's stop would kill it)."""
        # Workers and routers are named in the cluster's namespace (its name), as is this actor.
        namespace = self.spec.cluster_name
        named = [(a["name"], a.get("namespace")) for a in ray.util.list_named_actors(True)]
        highest = -1
        lost: list[WorkerRole] = []
        foreign: list[str] = []
        for name, ns in sorted(named):
            if name.startswith(ROUTER_PREFIX) and ns == namespace:
                self.routers.append(ray.get_actor(name, namespace=ns))
                continue
            if not name.startswith(ACTOR_NAME_PREFIX) or ns != namespace:
                continue
            worker_id = name[len(ACTOR_NAME_PREFIX) :]
            role_name, _, number = worker_id.rpartition("-")
            if role_name not in self._roles or not number.isdigit():
                foreign.append(worker_id)  # a worker some other code named: not ours to stop
                continue
            highest = max(highest, int(number))
            handle = ray.get_actor(name, namespace=namespace)
            try:
                info = cast(WorkerInfo, ray.get(handle.info.remote(), timeout=ADOPT_TIMEOUT_S))
                load = ray.get(handle.load.remote(), timeout=ADOPT_TIMEOUT_S)
            except Exception as e:
                self._log(f"controller restart: worker {worker_id} did not answer ({e}); killed")
                stop_worker(worker_id, handle, self.spec.cluster_name)
                with contextlib.suppress(ValueError):
                    lost.append(WorkerRole(role_name))
                continue
            placement = self.spec.worker_asks(info.role)
            w = Registered(info, info.role, worker_id, handle, placement, state=load.state)
            w.ready_at = time.time()
            self.workers[worker_id] = w
        self._ids = itertools.count(highest + 1)
        self._start_loops()
        for role in lost:
            self._spawn(self._replace(role))
        self._log(
            f"controller restarted: adopted {len(self.workers)} workers "
            f"({', '.join(sorted(self.workers)) or 'none'}) and {len(self.routers)} routers"
            + (f"; left alone: {', '.join(foreign)} (not named as this controller names)"
               if foreign else "")
        )  # fmt: skip

    async def shutdown(self) -> None:
        """Stop the loops and every worker; release the autoscaler request."""
        for task in (self._health_task, self._planner_task, *self._tasks):
            if task is not None:
                task.cancel()
        if self.planner is not None:
            self.planner.close()
        await asyncio.gather(*(self._stop(w) for w in list(self.workers.values())))
        if self._prefix_index is not None:
            self._prefix_index.close()
        self.metrics.close()

    def metrics_url(self) -> str:
        """Where this controller serves its Prometheus metrics ("" when it could not bind)."""
        return self.metrics.url

    def register_router(self, router: Any) -> None:
        """A router replica the planner reads latency samples and queue depth from."""
        self.routers.append(router)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        # (the actor's loop, also from __init__ after a restart, before the loop runs)
        task = asyncio.get_event_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- registry ---------------------------------------------------------------------------

    def list_workers(self) -> list[tuple[WorkerInfo, Any]]:
        """Workers routers keep in view: ready ones, and draining or drained ones (their
        running streams must go on; placement skips them by their reported state)."""
        return [(cast(WorkerInfo, w.info), w.handle) for w in listed(self.workers)]

    def list_workers_if_changed(self, known: RegistrySignature | None) -> WorkerListing | None:
        """`list_workers` with its signature, or None while that is still `known` (what
        routers ask every second: router/cluster_view.py `ControllerDirectory` says why)."""
        workers = listed(self.workers)
        current = signature(workers)
        if current == known:
            return None
        return WorkerListing(current, tuple((cast(WorkerInfo, w.info), w.handle) for w in workers))

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"worker_id": w.worker_id, "role": w.role.value, "state": w.state,
             "switching_to": w.switching_to.value if w.switching_to else None}
            for w in self.workers.values()
        ]  # fmt: skip

    def recent_events(self) -> list[str]:
        return [text for _, text in list(self.events)[-100:]]

    def events_since(self, seq: int) -> tuple[int, list[str]]:
        """Events numbered `seq` and later, and the number to ask from next time."""
        new = [(n, text) for n, text in self.events if n >= seq]
        return (new[-1][0] + 1 if new else seq), [text for _, text in new]

    def planner_decisions(self, since_tick: int = 0) -> list[tuple[int, str]]:
        """The planner's decisions from tick `since_tick` on (every tick, holds included, the
        last 1000 kept), oldest first, as (tick, "HH:MM:SS tick N: ... (reasons)")."""
        if self.planner is None:
            return []
        return [
            (r.tick, f"{time.strftime('%H:%M:%S', time.localtime(r.at_s))} {r.text}")
            for r in self.planner.records
            if r.tick >= since_tick
        ]

    def record_event(self, message: str) -> None:
        self._log(message)

    def _log(self, message: str) -> None:
        log.info(message)
        self.events.append((next(self._event_seq), f"{time.strftime('%H:%M:%S')} {message}"))

    def _worker_config(self, role: WorkerRole, worker_id: str) -> WorkerConfig:
        return WorkerConfig(
            worker_id=worker_id,
            role=role,
            engine=self.spec.engine_for(role),
            redis_url=self.spec.redis_url,
            namespace=self.spec.cluster_name,
            index=self.spec.index,
            torch_threads=self.spec.torch_threads,
            stall_timeout_s=self.spec.stall_timeout_s,
        )

    def _create_worker(self, role: WorkerRole) -> Registered:
        """Create the actor and register it as starting (its start() is not awaited yet)."""
        worker_id = f"{role.value}-{next(self._ids)}"
        placement = self.spec.placement_for(role)  # each rank's (a TP worker: N ranks)
        handle = create_worker(
            self._worker_config(role, worker_id), self.spec.transfer, placement, detached=True
        )
        w = Registered(None, role, worker_id, handle, self.spec.worker_asks(role))
        self.workers[worker_id] = w
        return w

    async def _start_worker(self, role: WorkerRole) -> WorkerInfo:
        return await self._await_ready(self._create_worker(role))

    async def _await_ready(self, w: Registered) -> WorkerInfo:
        worker_id, handle, role = w.worker_id, w.handle, w.role
        try:
            info: WorkerInfo = await wait_within(handle.start.remote(), self.spec.start_timeout_s)
        except BaseException as e:
            self.workers.pop(worker_id, None)
            stop_worker(worker_id, handle, self.spec.cluster_name)
            self.metrics.removed.labels(role.value, "start_failed").inc()
            self._log(f"worker {worker_id} failed to start: {e}")
            raise
        w.info, w.state, w.ready_at = info, WorkerState.READY, time.time()
        self.metrics.started.labels(role.value).inc()
        self._log(f"worker {worker_id} ({role.value}) ready on {info.device}, node {info.node}")
        if self._lora_enabled:
            await self._sync_loras(w)
        return info

    async def _sync_loras(self, w: Registered) -> None:
        """The adapter set may have changed while `w` started: bring it in line. A worker
        that cannot take an adapter serves on without it (placement sends it no request
        naming it: it does not report it registered)."""
        try:
            async with self._lora_lock:
                done = await lora_admin.sync_worker(w.handle, dict(self.spec.engine.loras))
        except Exception as e:
            self._log(f"worker {w.worker_id}: adapters not brought up to date: {e}")
            return
        if done:
            self._log(f"worker {w.worker_id}: adapters brought up to date ({done})")

    # ---- LoRA adapters (deploy/control/lora_admin.py)
    # -------------------------------------------------

    @property
    def _lora_enabled(self) -> bool:
        return self.spec.engine.enable_lora or bool(self.spec.engine.loras)

    def _listed_handles(self) -> dict[str, Any]:
        return {w.worker_id: w.handle for w in self.workers.values() if w.state in LISTED_STATES}

    def _set_loras(self, loras: dict[str, str]) -> None:
        self.spec = replace(self.spec, engine=replace(self.spec.engine, loras=tuple(loras.items())))

    async def load_lora(self, name: str, path: str) -> list[LoraEntry]:
        """Serve a PEFT adapter folder as `name` on every worker, now and started later."""
        async with self._lora_lock:
            loras = dict(self.spec.engine.loras)
            await lora_admin.register_everywhere(self._listed_handles(), loras, name, path)
            self._set_loras({**loras, name: path})
            self._log(f"lora {name} loaded from {path}")
        return await self.list_loras()

    async def unload_lora(self, name: str) -> list[LoraEntry]:
        """Stop serving adapter `name` (requests running on it finish)."""
        async with self._lora_lock:
            loras = dict(self.spec.engine.loras)
            self._set_loras({n: p for n, p in loras.items() if n != name})
            await lora_admin.unregister_everywhere(self._listed_handles(), loras, name)
            self._log(f"lora {name} unloaded")
        return await self.list_loras()

    async def list_loras(self) -> list[LoraEntry]:
        return await lora_admin.list_everywhere(
            self._listed_handles(), dict(self.spec.engine.loras)
        )

    async def add_worker(self, role: str) -> WorkerInfo:
        return await self._start_worker(WorkerRole(role))

    # ---- health -----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            try:
                await self.check_health()
            except Exception:
                log.exception("health check failed")

    async def check_health(self) -> list[str]:
        """Ping every ready worker; returns the ids found dead (and removed) this round."""
        ready = [w for w in self.workers.values() if w.state in LISTED_STATES]
        results = await asyncio.gather(
            *(wait_within(w.handle.ping.remote(), 2.0) for w in ready),
            return_exceptions=True,
        )
        dead: list[tuple[Registered, str]] = []
        for w, r in zip(ready, results, strict=True):
            if not isinstance(r, BaseException):
                w.failures = 0
                continue
            w.failures += 1
            if isinstance(r, WorkerUnhealthy):  # alive, but its engine fails every step
                dead.append((w, f"unhealthy ({r})"))
            elif isinstance(r, ray.exceptions.RayActorError):
                dead.append((w, "dead"))
            elif w.failures >= self.spec.failure_threshold:
                dead.append((w, f"dead ({w.failures} health checks failed)"))
        for w, why in dead:
            self.workers.pop(w.worker_id, None)
            reason = "unhealthy" if why.startswith("unhealthy") else "dead"
            self.metrics.removed.labels(w.role.value, reason).inc()
            self._log(f"worker {w.worker_id} is {why}; removed from placement")
            stop_worker(w.worker_id, w.handle, self.spec.cluster_name)
            self._spawn(self._purge_index(w.worker_id))
            if self.spec.replace_dead and w.state is WorkerState.READY:
                self._spawn(self._replace(w.role))
        return [w.worker_id for w, _ in dead]

    # ---- the prefix index -------------------------------------------------------------------

    def _index(self) -> PrefixIndex | None:
        if not self.spec.redis_url:
            return None
        if self._prefix_index is None:
            model_id = next((w.info.model_id for w in self.workers.values() if w.info), None)
            if model_id is None:
                return None
            self._prefix_index = PrefixIndex(self.spec.redis_url, model_id, self.spec.index)
        return self._prefix_index

    async def _purge_index(self, worker_id: str | None = None) -> None:
        """Drop a removed worker's prefix-index entries (None: those of every worker the
        registry does not hold). Best effort: Redis down leaves them to expire with the
        worker's liveness key."""
        index = self._index()
        if index is None:
            return
        try:
            if worker_id is not None:
                await asyncio.to_thread(index.purge_worker, worker_id)
            else:
                await asyncio.to_thread(index.purge_workers_except, set(self.workers))
        except Exception as e:
            log.warning("purging the prefix index (%s) failed: %s", worker_id or "stale", e)

    async def _replace(self, role: WorkerRole, attempts: int = 3) -> None:
        """A worker in place of a dead one. Ray may place it on a node that has just dropped
        off the network (the GCS takes a while to declare it dead): a replacement whose actor
        dies before it starts is tried again, and waits for a node with the resources."""
        for attempt in range(1, attempts + 1):
            try:
                info = await self._start_worker(role)
                self._log(f"replaced a dead {role.value} worker with {info.worker_id}")
                return
            except ray.exceptions.RayActorError as e:
                if attempt < attempts:
                    self._log(f"retrying the replacement of a dead {role.value} worker: {e}")
                    await asyncio.sleep(self.spec.health_interval_s)
                    continue
                self._log(f"could not replace a dead {role.value} worker: {e}")
            except Exception as e:
                self._log(f"could not replace a dead {role.value} worker: {e}")
                return

    # ---- the planner's host interface (planner/loop.py PlannerHost) ----------------------

    @property
    def rebalancing(self) -> bool:
        return self._lock.locked()

    async def worker_snapshots(self) -> list[WorkerSnapshot]:
        """Every registered worker with its load (starting ones, and failed calls, without)."""
        workers = list(self.workers.values())
        polled = [w for w in workers if w.state in LISTED_STATES]
        loads = await asyncio.gather(
            *(wait_within(w.handle.load.remote(), 2.0) for w in polled),
            return_exceptions=True,
        )
        by_id = {
            w.worker_id: load
            for w, load in zip(polled, loads, strict=True)
            if not isinstance(load, BaseException)
        }
        # a switching worker counts as a starting worker of its new role
        return [
            WorkerSnapshot(
                worker_id=w.worker_id,
                role=planner_role(w.switching_to or w.role),
                ready_at_s=None if w.switching_to else w.ready_at,
                draining=not w.switching_to
                and w.state in (WorkerState.DRAINING, WorkerState.DRAINED),
                load=by_id.get(w.worker_id),
            )
            for w in workers
        ]

    async def router_signals(self, since_s: float) -> list[RouterSignals]:
        results = await asyncio.gather(
            *(wait_within(r.signals.remote(since_s), 2.0) for r in self.routers),
            return_exceptions=True,
        )
        return [r for r in results if isinstance(r, RouterSignals)]

    def spawn_worker(self, role: WorkerRole) -> str:
        """Create a worker and start it in the background; returns its id at once."""
        w = self._create_worker(role)

        async def start() -> None:
            with contextlib.suppress(Exception):  # _await_ready logs the failure
                await self._await_ready(w)

        self._spawn(start())
        return w.worker_id

    def begin_switch(self, worker_id: str, role: WorkerRole) -> bool:
        """Start switching a ready worker to `role` in the background (`role_switch`); False
        when it cannot (the planner then drains it and starts a worker instead)."""
        return role_switch.begin_switch(self, worker_id, role, self._spawn)

    def begin_drain(self, worker_id: str) -> None:
        """Stop admitting on a worker (it finishes its in-flight work); returns at once."""
        w = self.workers.get(worker_id)
        if w is None or w.state is not WorkerState.READY:
            return
        w.state = WorkerState.DRAINING
        w.handle.drain.remote(0.0)  # sets DRAINING and returns; the planner watches its load
        self._log(f"draining {worker_id}")

    def stop_when_drained(self, worker_id: str) -> None:
        """Stop a draining worker once it confirms it has no in-flight work."""
        w = self.workers.get(worker_id)
        if w is None or w.state is not WorkerState.DRAINING:
            return

        async def stop() -> None:
            if await w.handle.drain.remote(5.0):
                await self._stop(w)
            else:
                self._log(f"{worker_id} still has in-flight work; not stopped")

        self._spawn(stop())

    def wanted_placements(self) -> list[ActorPlacement]:
        """Placements of the workers that should have room: starting, ready and switching."""
        return [w.placement for w in self.workers.values() if w.wanted_as is not None]

    # ---- drain and rebalance (deploy/control/rebalance.py)
    # ------------------------------------------

    async def drain(
        self, worker_id: str, stop: bool, timeout_s: float, force: bool = False
    ) -> DrainReport:
        """Stop admitting on a worker and let its running requests finish (up to
        `timeout_s`); with `stop`, stop it then. See `rebalance.drain`."""
        return await rebalance.drain(self, worker_id, stop, timeout_s, force)

    async def undrain(self, worker_id: str) -> str:
        """Put a draining or drained (not stopped) worker back into service."""
        return await rebalance.undrain(self, worker_id)

    async def _stop(self, w: Registered) -> None:
        if self.workers.pop(w.worker_id, None) is not None:
            self.metrics.removed.labels(w.role.value, "stopped").inc()
        with contextlib.suppress(Exception):
            await wait_within(w.handle.shutdown.remote(), 30)
        stop_worker(w.worker_id, w.handle, self.spec.cluster_name)
        w.state = WorkerState.STOPPED
        self._log(f"worker {w.worker_id} stopped")
        await self._purge_index(w.worker_id)

    async def rebalance(
        self, prefill: int, decode: int, timeout_s: float, restart: bool = False
    ) -> RebalanceReport:
        """Reach `prefill` prefill and `decode` decode workers, switching workers in place
        where one role shrinks while the other grows (unless `restart`), draining before
        stopping (`rebalance.rebalance`)."""
        return await rebalance.rebalance(self, prefill, decode, timeout_s, restart)

    async def switch(
        self, worker_id: str, role: str, timeout_s: float, force: bool = False
    ) -> RoleSwitch:
        """Move a worker to `role` in place: drain, flip, admit as `role`, no restart
        (deploy/control/role_switch.py); `RoleSwitchRefused` naming what is wrong, with
        nothing changed."""
        async with self._lock:
            w, new = role_switch.refuse_switch(self, worker_id, role, force)
            return await role_switch.run_switch(self, w, new, timeout_s)


def _log_to_stderr() -> None:
    """Show the controller's INFO lines (worker lifecycle, planner actions) in its Ray log,
    which a local driver prints (log_to_driver): Ray leaves actors' loggers at WARNING."""
    for name in ("deploy", "planner"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            fmt = logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S")
            handler.setFormatter(fmt)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
    # Every tick's decision goes to the planner loop's records (and the control log); the log
    # shows the ones that act (planner.loop), not every hold.
    logging.getLogger("planner.core").setLevel(logging.WARNING)


def _restarted_actor() -> bool:
    """This process is a Ray actor that Ray made again after it died (not its first start;
    False outside an actor, e.g. a controller driven directly by a test)."""
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)
