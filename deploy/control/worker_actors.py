"""Create worker actors on Ray: resources, names and restart policy from config.

One actor per GPU (`num_gpus=1`) where the cluster has GPUs, else a fractional CPU slot. The
actor is a `RoleHost` (worker_runtime/role_host.py) serving its role through the role's class
(`ROLE_CLASSES`), so the controller can switch its role without reloading its model. It is
named `pdserve-worker-{id}` in the cluster's namespace (decode workers find prefill peers by
that name for the KV handshake).

A tensor-parallel worker of N ranks is N actors on one node: a placement group of N bundles
(STRICT_PACK; each bundle one rank's placement), named `pdserve-tp-{id}`, with the worker's
actor (rank 0) in bundle 0 and a follower actor (worker_runtime/tp_follower.py, named
`pdserve-tp-rank{r}-{id}`, outside the workers' name prefix) in bundle r. `stop_worker`
kills the worker's actor and removes its group, which ends the followers too: nothing of a
stopped or dead TP worker is left on Ray. It asks N times a rank's placement
(`ActorPlacement.times`). A pipeline-parallel worker of S stages of T ranks is the same with
N = S x T ranks (rank stage * T + tp rank in bundle rank), its group PACK rather than
STRICT_PACK: one node where it fits, else stages spread over the Ray cluster's nodes.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import ray

from decode_worker.worker import DecodeWorker
from kv_transfer.config import KVTransferConfig
from prefill_worker.worker import PrefillWorker
from vocabulary.worker_api import ActorPlacement, WorkerInfo, WorkerRole, actor_name_for
from worker_runtime.role_host import RoleClasses, RoleHost
from worker_runtime.runtime import WorkerConfig


def default_placement() -> ActorPlacement:
    """One GPU per worker where the cluster has GPUs, else half a CPU."""
    gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    if gpus >= 1:
        return ActorPlacement(num_gpus=1.0, num_cpus=1.0)
    return ActorPlacement()


def _asked(workers: list[tuple[str, ActorPlacement]]) -> dict[str, dict[str, float]]:
    """Resource -> role -> amount the workers (role, placement) ask for in all."""
    per_role: dict[str, dict[str, float]] = {}
    for role, p in workers:
        asks = {"GPU": p.num_gpus, "CPU": p.num_cpus, **dict(p.resources)}
        for name, amount in asks.items():
            if amount > 0:
                by_role = per_role.setdefault(name, {})
                by_role[role] = by_role.get(role, 0.0) + amount
    return per_role


def _first_short(
    workers: list[tuple[str, ActorPlacement]], available: dict[str, float]
) -> tuple[str, float, float, str] | None:
    """(resource, total asked, what there is, "role n, ...") of the first resource (by name)
    the workers ask more of than `available` has; None when they all fit."""
    for name, by_role in sorted(_asked(workers).items()):
        total, have = sum(by_role.values()), available.get(name, 0.0)
        if total > have + 1e-9:
            asked = ", ".join(f"{role} {n:g}" for role, n in sorted(by_role.items()))
            return name, total, have, asked
    return None


def capacity_shortfall(
    wanted: list[tuple[str, ActorPlacement]], available: dict[str, float]
) -> str | None:
    """Why `wanted` workers (role, placement) cannot all be placed on `available` Ray
    resources, or None when they fit. For a Ray whose resources are fixed (a local one, no
    autoscaler): there, a worker that does not fit would wait for a node that never comes."""
    short = _first_short(wanted, available)
    if short is None:
        return None
    name, total, have, asked = short
    hint = "start fewer workers, or give each a smaller share (placement)"
    if name == "GPU" and have >= 1:
        # sharing a GPU between a prefill and a decode process is slow (UCX moves the KV
        # between two processes on one device over TCP): one colocated worker per GPU
        hint = f"on {have:g} GPU(s) run colocated workers (--colocated --decode {have:g})"
    return f"the workers need {total:g} {name} ({asked}) but this Ray has {have:g}: {hint}"


def rebalance_shortfall(
    staying: list[tuple[str, ActorPlacement]],
    starting: list[tuple[str, ActorPlacement]],
    cluster_resources: dict[str, float],
) -> str | None:
    """Why a rebalance could never place the workers it would start, or None when they fit
    (or it starts none). For a Ray whose resources are fixed, checked before anything drains.

    `staying`: (role, placement) of every worker that holds Ray resources now and that the
    rebalance does not stop: ready and starting ones it keeps, and draining or drained ones
    (a drained worker that was not stopped keeps its GPU). `starting`: the workers it would
    create. `cluster_resources`: the Ray's total (`ray.cluster_resources()`), not what is free
    now: the workers it stops free theirs before the new ones start, so at the peak only the
    staying and the starting workers hold resources (controller and routers ask for no CPU)."""
    if not starting:
        return None
    short = _first_short(staying + starting, cluster_resources)
    if short is None:
        return None
    name, total, have, asked = short
    new: dict[str, int] = {}
    for role, _ in starting:
        new[role] = new.get(role, 0) + 1
    new_text = ", ".join(f"{n} {role}" for role, n in sorted(new.items()))
    return (
        f"the rebalance would start {new_text} worker(s); with the {len(staying)} staying they "
        f"need {total:g} {name} ({asked}) but this Ray has {have:g} (a local Ray keeps the "
        "resources it started with): ask for fewer workers (a drained worker that was not "
        "stopped keeps its share)"
    )


ROLE_CLASSES: RoleClasses = {
    WorkerRole.PREFILL: PrefillWorker,
    WorkerRole.DECODE: DecodeWorker,
    WorkerRole.COLOCATED: DecodeWorker,
    WorkerRole.SPLIT: DecodeWorker,
}
"""The class that serves each role inside a worker's actor (`RoleHost`, which switches it)."""


def tp_group_name(worker_id: str, cluster: str = "pdserve") -> str:
    """The placement group of a TP worker's ranks (its cluster's name in it: placement group
    names are not namespaced)."""
    return f"{cluster}-tp-{worker_id}"


NO_TASK_EVENTS: dict[str, Any] = {"enable_task_events": False}
"""Options of every pdserve actor: Ray records no task events for their method calls. By
default each call (every generate stream, health probe and token-channel batch) leaves an
event in the GCS, which keeps up to 100,000 of them: a 30-minute soak grew Ray's gcs_server by
~1.4 GB/hour with them (docs/benchmarks.md, "Chaos and soak"). Ray Serve turns them off for
its replicas too."""


def follower_name(worker_id: str, rank: int) -> str:
    """The actor name of rank `rank` (> 0) of a TP or pipeline worker."""
    return f"pdserve-tp-rank{rank}-{worker_id}"


def with_memory_share(config: WorkerConfig, placement: ActorPlacement) -> WorkerConfig:
    """`config` with its engine's `gpu_memory_share` set to the placement's fraction of a GPU
    (0 < num_gpus < 1: workers sharing a card size their KV pools from their own share,
    engine/kv/kv_sizing.py) unless the engine config sets a share of its own."""
    engine = config.engine
    if 0 < placement.num_gpus < 1 and engine.gpu_memory_share == 1.0:
        return replace(config, engine=replace(engine, gpu_memory_share=placement.num_gpus))
    return config


def create_worker(
    config: WorkerConfig,
    transfer: KVTransferConfig,
    placement: ActorPlacement | None = None,
    detached: bool = False,
) -> Any:
    """Create (not start) the actor; call `.start.remote()` on the handle and await it.
    `placement`: each rank's (a TP worker's N ranks ask N times it, in one placement group).

    `detached`: the actor outlives its creator (the controller's workers: a controller that
    dies and restarts adopts them; whoever stops the cluster kills them)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from worker_runtime.tp_follower import TPFollower

    placement = placement or default_placement()
    config = with_memory_share(config, placement)
    name = actor_name_for(config.worker_id)
    lifetime = {"lifetime": "detached"} if detached else {}
    # named in the cluster's namespace (the followers too), or the creator's
    naming = {"namespace": config.namespace} if config.namespace is not None else {}
    options: dict[str, Any] = {
        "num_gpus": placement.num_gpus,
        "num_cpus": placement.num_cpus,
        "resources": dict(placement.resources),
        "max_concurrency": 4096,
        **NO_TASK_EVENTS,
        **lifetime,
        **naming,
    }
    size = config.engine.num_ranks
    followers: list[Any] = []
    if size > 1:
        group = placement_group(
            [placement.bundle()] * size,
            strategy="PACK" if config.engine.pipeline_parallel_size > 1 else "STRICT_PACK",
            name=tp_group_name(config.worker_id, config.namespace or "pdserve"), **lifetime,
        )  # fmt: skip

        def in_bundle(rank: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)

        follower_cls: Any = ray.remote(TPFollower)
        followers = [
            follower_cls.options(
                name=follower_name(config.worker_id, rank),
                scheduling_strategy=in_bundle(rank),
                **options,
            ).remote(config, transfer, rank)
            for rank in range(1, size)
        ]
        options["scheduling_strategy"] = in_bundle(0)
    remote_cls: Any = ray.remote(RoleHost)
    return remote_cls.options(name=name, max_restarts=placement.max_restarts, **options).remote(
        config, transfer, name, tuple(followers), ROLE_CLASSES
    )


def stop_worker(worker_id: str, handle: Any, cluster: str = "pdserve") -> None:
    """Kill a worker's actor and, for a TP worker, remove its placement group (which ends its
    follower ranks); quiet about what is already gone."""
    from ray.util import get_placement_group, remove_placement_group

    with contextlib.suppress(Exception):
        ray.kill(handle)
    try:
        group = get_placement_group(tp_group_name(worker_id, cluster))
    except ValueError:  # no such group: a worker of one rank, or removed already
        return
    except ray.exceptions.RaySystemError:  # no Ray here (any more): nothing of it is left
        return
    with contextlib.suppress(Exception):
        remove_placement_group(group)


def start_worker_sync(
    config: WorkerConfig,
    transfer: KVTransferConfig,
    placement: ActorPlacement | None = None,
    timeout_s: float = 600.0,
) -> tuple[Any, WorkerInfo]:
    """Create and start a worker, blocking until its model is loaded."""
    handle = create_worker(config, transfer, placement)
    info = ray.get(handle.start.remote(), timeout=timeout_s)
    return handle, info
