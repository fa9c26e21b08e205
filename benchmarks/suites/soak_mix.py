"""The soak's mixed load beyond its closed-loop clients (benchmarks/suites/soak.py): the
cluster operations a long-running server sees, on a timer, and what each worker holds
once the load is over.

- a drain and undrain of a decode worker every `drain_every_s` (the other decode worker
  serves meanwhile; `pdserve drain` / `undrain` do the same);
- a migration: one decode worker killed mid-run (`kill_at_s`), its streams moved by the
  router to the other decode worker, the controller starting a replacement;
- the counters that must come back to the idle baseline (KV blocks, leases, transfers,
  fds, threads, asyncio tasks) read from every worker before the load and after it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any


def decode_workers(cluster: Any) -> list[tuple[str, Any]]:
    """(worker id, handle) of the cluster's ready decode workers, oldest first."""
    import ray

    workers = ray.get(cluster.controller.list_workers.remote(), timeout=60)
    return sorted((info.worker_id, h) for info, h in workers if info.role.value == "decode")


def drain_and_undrain(cluster: Any, timeout_s: float = 30.0) -> str:
    """Drain the first decode worker (not stopped; refused if it is the last ready one),
    then put it back. Returns what the controller said, for the log."""
    import ray

    ids = [w for w, _ in decode_workers(cluster)]
    if len(ids) < 2:
        return f"drain skipped: {len(ids)} decode worker(s)"
    ctl = cluster.controller
    report = ray.get(ctl.drain.remote(ids[0], False, timeout_s), timeout=timeout_s + 30)
    # drained, or still draining past the timeout: undrain puts it back either way
    said = ray.get(ctl.undrain.remote(ids[0]), timeout=30)
    return f"{report.message}; {said}"


def kill_decode_worker(cluster: Any, wait_s: float = 180.0) -> str:
    """Kill the newest decode worker while streams run on it (the router migrates them);
    wait, up to `wait_s`, until the controller has a replacement ready."""
    import ray

    before = decode_workers(cluster)
    if len(before) < 2:
        return f"kill skipped: {len(before)} decode worker(s)"
    victim, handle = before[-1]
    ray.kill(handle, no_restart=True)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        now = [w for w, _ in decode_workers(cluster)]
        if victim not in now and len(now) >= len(before):
            return f"killed {victim}; replaced by {sorted(set(now) - {w for w, _ in before})}"
        time.sleep(1.0)
    raise TimeoutError(f"no replacement for {victim} within {wait_s:g}s")


def worker_counts(cluster: Any, settle_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Every worker's held resources (`WorkerLoad.held`: "" when idle) and process counts
    (fds, threads, asyncio tasks), once they stop changing over 2 s (within `settle_s`)."""
    import ray

    def read() -> dict[str, dict[str, Any]]:
        out = {}
        for info, h in ray.get(cluster.controller.list_workers.remote(), timeout=60):
            load = ray.get(h.load.remote(), timeout=30)
            out[info.worker_id] = {"held": load.held(), **asdict(load.process),
                                   "kv_free": load.engine.num_free_blocks,
                                   "kv_total": load.engine.num_total_blocks}  # fmt: skip
        return out

    end = time.monotonic() + settle_s
    last = read()
    while time.monotonic() < end:
        time.sleep(2.0)
        now = read()
        if now == last and not any(v["held"] for v in now.values()):
            break
        last = now
    return last


def router_migrations(cluster: Any) -> dict[str, float]:
    """Each router's migration count by how (its `pdserve_migrations` counter)."""
    import ray

    def count(router: Any) -> dict[str, float]:
        out = {}
        for metric in router.server.metrics.migrations.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get("how", "")] = s.value
        return out

    return {f"router-{i}": ray.get(r.__ray_call__.remote(count), timeout=60)
            for i, r in enumerate(cluster.routers)}  # fmt: skip
