"""Soak: steady load on a local cluster for a long time, every process's memory sampled.

A 1P1D cluster (tiny model, CPU; every prompt handed off) serves `--concurrency` closed-loop
clients for `--minutes`: prompts of random tokens under cache salts from a small set (so the
prefix cache fills, hits and evicts), random lengths, a share of the streams cancelled after
a few tokens. Every `--sample-s` each process of the cluster (the controller, the routers,
the workers, the embedded redis-server) is sampled: its RSS by kind of mapping and thread
count (benchmarks/harness/proc_stats.py) and, inside the Ray actors, glibc malloc's account
(`mallinfo2`: heap got from the system, in use, free).

Flat, per process: the least-squares slope of its RSS over the last two thirds of the run
(after a warm-up of the first third, while caches, pools, allocator arenas and the router's
bounded latency windows fill) is at most `--max-slope-mb-h` (default 5 MB/hour: 120 MB a
day). A leak grows linearly for as long as the load runs; what an allocator keeps settles, so
its slope after the warm-up is ~0. A 30-minute run resolves a slope to a few MB/hour (RSS
steps of ~1-2 MB as glibc's arenas grow and shrink), so a smaller threshold would judge
noise; the slope's standard error is reported beside it.

The processes: pdserve's (controller, routers, workers, the embedded redis-server) and the
local Ray's own `gcs_server` and `raylet`.

    python -m benchmarks soak --minutes 30 --out soak.json
    python -m benchmarks soak --minutes 6 --sample-s 15          # a quick look
    python -m benchmarks soak --minutes 6 --env MALLOC_ARENA_MAX=8 # an allocator experiment

`--env K=V` adds to (or overrides) what the cluster puts in its actors' environment;
`--trim-at-end` calls `malloc_trim(0)` in every actor once the load stops and reports what
that handed back (free memory malloc held, not a leak); `--objects` counts the Python
objects of each actor by type at the end of the warm-up and at the end, and reports the
types whose count grew most. `--tracemalloc [NAMES]` traces every actor's (or those whose
names start with one of the comma-separated NAMES: `controller,router`) Python allocations
(`--tracemalloc-frames`, default 4) from the start, samples the traced heap and
tracemalloc's own memory, and reports the sites (tracebacks) whose live memory grew most
between the end of the warm-up and the end; `--memray PROCESS` tracks that actor's native
allocations with memray from the end of the warm-up and reports what it still held at the
end, by native and Python stack. The mixed load (benchmarks/suites/soak_mix.py):
`--decode 2 --drain-every-min M --kill-at-min K` drains and undrains a decode worker every M
minutes and kills one at minute K (the router migrates its streams; the replacement is
sampled from then on); every worker's KV blocks, leases, fds, threads and tasks are read
idle before and after the load. `--plot PNG` draws the RSS of each process over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc
import psutil

from benchmarks.harness import proc_stats
from benchmarks.harness.cluster import actor_pid, local_cluster, tiny_disaggregated
from benchmarks.harness.table import Table
from benchmarks.suites import soak_mix, soak_probes
from benchmarks.suites.soak_probes import (
    channel_stats,
    loop_tasks,
    memray_growth,
    object_counts,
    periodic_trim_stats,
    start_memray,
    start_tracemalloc,
    stop_memray,
    stream_generators,
    traced_at_warm,
    traced_growth,
    traced_mb,
)
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc


class Process:
    """One process of the cluster: its pid and, for a Ray actor, its handle."""

    def __init__(self, pid: int, actor: Any = None) -> None:
        self.pid = pid
        self.actor = actor

    def call(self, fn: Any, timeout: float = 60.0) -> Any:
        """`fn()` inside the actor, on its event loop (`call_on`)."""
        return self.call_on(lambda _: fn(), timeout)

    def call_on(self, fn: Any, timeout: float = 60.0) -> Any:
        """`fn(actor instance)` inside the actor, on its event loop's thread when it has one.
        Ray runs `__ray_call__` on a thread of its own beside the loop; a probe that walks
        `gc.get_objects()` there holds references to objects the loop is still building, and
        the tuple `asyncio.gather(*(...))` builds from a generator cannot be resized while
        another reference to it exists (the router's load poll failed with `SystemError:
        bad argument to internal function` in the first soaks)."""
        import ray

        return ray.get(self.actor.__ray_call__.remote(on_actor_loop(fn, timeout)), timeout=timeout)


def on_actor_loop(fn: Any, timeout: float) -> Any:
    """`fn` wrapped to run on the calling actor's default event loop (directly in a threaded
    actor)."""

    def run(actor: Any) -> Any:
        import asyncio

        import ray
        from ray._raylet import PythonFunctionDescriptor

        worker = ray._private.worker.global_worker.core_worker
        if not worker.current_actor_is_asyncio():
            return fn(actor)
        descriptor = PythonFunctionDescriptor(__name__, "probe", type(actor).__name__)
        loop, _ = worker.get_event_loop(descriptor, None)  # the default concurrency group's

        async def on_loop() -> Any:
            return fn(actor)

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(timeout)

    return run


RAY_SYSTEM = ("gcs_server", "raylet")
"""Ray's own processes of the local Ray this script starts (children of this process)."""


def processes(cluster: Any) -> dict[str, Process]:
    """name -> Process of every process of the cluster: pdserve's (controller, routers,
    workers, the embedded redis-server) and the local Ray's `RAY_SYSTEM` ones."""
    import ray

    def of(actor: Any) -> Process:
        return Process(actor_pid(actor), actor)

    out = {"controller": of(cluster.controller)}
    for i, router in enumerate(cluster.routers):
        out[f"router-{i}"] = of(router)
    for info, handle in ray.get(cluster.controller.list_workers.remote(), timeout=60):
        out[info.worker_id] = of(handle)
    if cluster.redis is not None and cluster.redis.process is not None:
        out["redis-server"] = Process(cluster.redis.process.pid)
    for child in psutil.Process().children():
        if child.name() in RAY_SYSTEM:
            out[f"ray-{child.name()}"] = Process(child.pid)
    return out


def sample(procs: dict[str, Process]) -> dict[str, dict[str, Any]]:
    """name -> memory breakdown (+ malloc's account for actors) of every process now."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in procs.items():
        try:
            row: dict[str, Any] = asdict(proc_stats.breakdown(p.pid))
        except (FileNotFoundError, ProcessLookupError):
            out[name] = {"rss_mb": float("nan")}
            continue
        if p.actor is not None:
            row["malloc"] = p.call(proc_stats.malloc_stats)
            row.update(p.call(traced_mb))
            if name.startswith("router-"):  # retired token-channel subscriptions still held
                row["draining"] = sum(c["draining"] for c in p.call_on(channel_stats).values())
                row["generators"] = p.call_on(stream_generators)
        out[name] = row
    return out


TENANTS = ("", "acme", "globex", "initech")
"""The tenants the load spreads over ("" is the default tenant)."""


async def load(target: str, concurrency: int, end: float, seed: int) -> dict[str, int]:
    """Closed-loop clients until `end`: short prompts and a tenth long ones, four tenants
    and two priorities, a tenth of the streams cancelled after a few tokens and a
    twentieth under a deadline short enough to cut some. Returns the count per status."""
    counts: dict[str, int] = {}
    rng = random.Random(seed)
    salts = [f"s{i}" for i in range(8)]

    async def client(stub: Any) -> None:
        while time.monotonic() < end:
            n_prompt = rng.randrange(400, 900) if rng.random() < 0.1 else rng.randrange(20, 200)
            prompt = [rng.randrange(10, 500) for _ in range(n_prompt)]
            req = pb.GenerateRequest(
                token_ids=prompt, max_tokens=rng.randrange(4, 48), temperature=0.0,
                ignore_eos=True, cache_salt=rng.choice(salts), tenant=rng.choice(TENANTS),
                priority=rng.randrange(0, 2),
            )  # fmt: skip
            cancel_at = rng.randrange(1, 4) if rng.random() < 0.1 else None
            deadline = rng.uniform(0.05, 0.5) if rng.random() < 0.05 else 120.0
            call = stub.Generate(req, timeout=deadline)
            status = "OK"
            try:
                n = 0
                async for msg in call:
                    n += len(msg.token_ids)
                    if cancel_at is not None and n >= cancel_at:
                        call.cancel()
            except asyncio.CancelledError:
                status = "CANCELLED"
            except grpc.aio.AioRpcError as e:
                status = e.code().name
            counts[status] = counts.get(status, 0) + 1

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
    return counts


def slope_mb_per_h(times: list[float], values: list[float]) -> float:
    """Least-squares slope of `values` (MB) over `times` (s), in MB/hour."""
    n = len(times)
    mt, mv = sum(times) / n, sum(values) / n
    den = sum((t - mt) ** 2 for t in times) or 1.0
    return sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / den * 3600


def slope_stderr_mb_per_h(times: list[float], values: list[float]) -> float:
    """The standard error of `slope_mb_per_h` (residuals taken as independent, which
    they are not quite: read it as a lower bound)."""
    n = len(times)
    if n < 3:
        return float("nan")
    mt, mv = sum(times) / n, sum(values) / n
    den = sum((t - mt) ** 2 for t in times) or 1.0
    b = slope_mb_per_h(times, values) / 3600
    resid = sum((v - mv - b * (t - mt)) ** 2 for t, v in zip(times, values, strict=True))
    return (resid / (n - 2) / den) ** 0.5 * 3600


def table(report: dict[str, Any]) -> str:
    """The per-process verdict as a Markdown table (docs/benchmarks.md): RSS, and where
    tracemalloc ran the RSS less tracemalloc's own memory, malloc's bytes in use and the
    Python heap it traced."""
    header = ("process", "RSS at start (MB)", "after warm-up", "at end",
              "RSS slope after warm-up (MB/h)", "less tracemalloc's own", "malloc in use",
              "Python heap (traced)", "flat")  # fmt: skip

    def of(row: dict[str, Any], key: str, stderr: str | None = None) -> str:
        if key not in row:
            return "-"
        return f"{row[key]:+.1f}" + (f" ± {row[stderr]:.1f}" if stderr else "")

    rows = [
        (name, f"{row['rss_start_mb']:.1f}", f"{row['rss_warm_mb']:.1f}",
         f"{row['rss_end_mb']:.1f}", of(row, "slope_rss_mb_h", "slope_rss_stderr_mb_h"),
         of(row, "slope_rss_less_tracemalloc_mb_h", "slope_rss_less_tracemalloc_stderr_mb_h"),
         of(row, "slope_malloc_in_use_mb_h"), of(row, "slope_traced_mb_h"),
         "yes" if row["flat"] else "**no**")
        for name, row in report["processes"].items()
    ]  # fmt: skip
    return Table.of(header, rows, "lrrrrrrrl").markdown()


def grown_mappings(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                   top: int = 6) -> list[str]:  # fmt: skip
    """The mappings whose resident size grew most (new ones included), as text."""
    deltas = []
    for key, (size, res) in after.items():
        grew = res - before.get(key, (0.0, 0.0))[1]
        if grew >= 0.5:
            deltas.append((grew, f"{key or '?'} size {size:.0f} MB: +{grew:.1f} MB"))
    gone = sum(res for key, (_, res) in before.items() if key not in after)
    out = [text for _, text in sorted(deltas, reverse=True)[:top]]
    if gone >= 0.5:
        out.append(f"(mappings gone since: -{gone:.1f} MB)")
    return out


def grown_objects(before: dict[str, int], after: dict[str, int], top: int = 8) -> list[str]:
    deltas = sorted(((n - before.get(k, 0), k) for k, n in after.items()), reverse=True)
    return [f"{k} +{d}" for d, k in deltas[:top] if d > 0]


def parse_env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--env wants KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--max-slope-mb-h", type=float, default=5.0)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trim-at-end", action="store_true")
    ap.add_argument("--objects", action="store_true")
    ap.add_argument("--tracemalloc", nargs="?", const="", default=None, metavar="NAMES")
    ap.add_argument("--tracemalloc-frames", type=int, default=4)
    ap.add_argument("--memray", default=None, metavar="PROCESS")
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--drain-every-min", type=float, default=0.0)
    ap.add_argument("--kill-at-min", type=float, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--heap-profile", type=Path, default=None, metavar="DIR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    extra_env = parse_env(args.env)
    if args.heap_profile is not None:
        args.heap_profile.mkdir(parents=True, exist_ok=True)
        prefix = str(args.heap_profile.resolve() / "auto")
        extra_env = {**proc_stats.jemalloc_profile_env(prefix), **extra_env}

    from deploy.control.local_ray import loopback_env

    loopback_env()  # before Ray is imported
    import ray

    import deploy.control.launch as launch

    # the functions the actors run travel by value: an actor need not import benchmarks
    ray.cloudpickle.register_pickle_by_value(proc_stats)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(soak_probes)
    if extra_env:  # what the cluster hands its actors (deploy/control/launch.py)
        base_env = launch.tracing_env

        def actor_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
            return {**base_env(environ), **extra_env}

        launch.tracing_env = actor_env
    config = tiny_disaggregated(num_kv_blocks=256, worker_cpus=0, ray_cpus=None)
    config = replace(config, workers=replace(config.workers, num_decode=args.decode))
    warm = args.minutes * 60 / 3
    samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
    maps_warm: dict[str, dict[str, tuple[float, float]]] = {}
    maps_end: dict[str, dict[str, tuple[float, float]]] = {}
    objs_warm: dict[str, dict[str, int]] = {}
    objs_end: dict[str, dict[str, int]] = {}
    trimmed: dict[str, dict[str, float]] = {}
    periodic: dict[str, dict[str, float]] = {}
    traced: dict[str, list[str]] = {}
    events: list[tuple[float, str]] = []
    memray_leaks: list[str] = []
    with local_cluster(config) as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        procs = processes(cluster)
        actors = {n: p for n, p in procs.items() if p.actor is not None}
        print("pids: " + " ".join(f"{n}={p.pid}" for n, p in procs.items()), flush=True)
        idle_before = soak_mix.worker_counts(cluster)

        def traces(name: str) -> bool:  # `--tracemalloc` alone: every actor
            return args.tracemalloc is not None and name.startswith(
                tuple(args.tracemalloc.split(","))
            )

        for name, p in actors.items():
            if traces(name):
                p.call(lambda: start_tracemalloc(args.tracemalloc_frames))
        memray_path = None
        if args.memray is not None:
            memray_path = (args.out or Path("soak.json")).with_suffix(f".{args.memray}.memray")
            memray_path.unlink(missing_ok=True)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_drain = t0 + args.drain_every_min * 60 if args.drain_every_min > 0 else float("inf")
        kill_at = t0 + args.kill_at_min * 60 if args.kill_at_min is not None else float("inf")

        def event(what: str) -> None:
            events.append((round(time.monotonic() - t0, 1), what))
            print(f"event at {events[-1][0]:.0f}s: {what}", flush=True)

        def snapshot(maps: dict[str, Any], objs: dict[str, Any]) -> None:
            for name, p in procs.items():
                with contextlib.suppress(OSError):  # a process gone (a worker killed)
                    maps[name] = proc_stats.mappings(p.pid)
            if args.objects:
                for name, p in actors.items():
                    objs[name] = p.call(object_counts, timeout=120)
            if args.heap_profile is not None:
                stage = "warm" if objs is objs_warm else "end"
                for name, p in actors.items():
                    path = str(args.heap_profile.resolve() / f"{name}.{stage}.heap")
                    if not p.call(lambda path=path: proc_stats.heap_dump(path)):
                        print(f"{name}: no jemalloc heap profile (is jemalloc preloaded?)")
            for name, p in actors.items():
                if traces(name):
                    if objs is objs_warm:
                        p.call(traced_at_warm, timeout=300)
                    else:
                        try:
                            traced[name] = p.call(traced_growth, timeout=300)
                        except Exception as e:  # killed meanwhile: report the rest
                            traced[name] = [f"not read: {type(e).__name__}: {e}"[:200]]
            if memray_path is not None:
                p = actors[args.memray]
                if objs is objs_warm:
                    p.call(lambda: start_memray(str(memray_path.resolve())))
                else:
                    p.call(stop_memray, timeout=300)

        async def run() -> dict[str, int]:
            task = asyncio.create_task(load(target, args.concurrency, end,
                                            args.seed))  # fmt: skip
            while not task.done():
                nonlocal kill_at, next_drain
                if time.monotonic() >= kill_at:
                    kill_at = float("inf")
                    event(await asyncio.to_thread(soak_mix.kill_decode_worker, cluster))
                    fresh = processes(cluster)  # the replacement sampled from now on
                    for name in procs.keys() - fresh.keys():
                        del procs[name], actors[name]
                    for name in fresh.keys() - procs.keys():
                        procs[name] = actors[name] = fresh[name]
                        if traces(name):
                            fresh[name].call(lambda: start_tracemalloc(args.tracemalloc_frames))
                if time.monotonic() >= next_drain:
                    next_drain += args.drain_every_min * 60
                    event(await asyncio.to_thread(soak_mix.drain_and_undrain, cluster))
                now = time.monotonic() - t0
                if not maps_warm and now >= warm:
                    snapshot(maps_warm, objs_warm)
                samples.append((now, sample(procs)))
                print(f"{now:7.0f}s " + " ".join(
                    f"{k}={v['rss_mb']:.1f}/{v.get('threads', 0)}t"
                    + (f"[draining {v['draining']} generators {v['generators']}]"
                       if "draining" in v else "")
                    + (f"(inuse {v['malloc'].get('in_use', 0):.0f} free "
                       f"{v['malloc'].get('free', 0):.0f})" if v.get("malloc") else "")
                    for k, v in samples[-1][1].items()), flush=True)  # fmt: skip
                await asyncio.wait([task], timeout=args.sample_s)
            return task.result()

        counts = asyncio.run(run())
        samples.append((time.monotonic() - t0, sample(procs)))
        snapshot(maps_end, objs_end)
        channels = {name: p.call_on(channel_stats)
                    for name, p in actors.items() if name.startswith("router-")}  # fmt: skip
        idle_after = soak_mix.worker_counts(cluster)
        worker_tasks = {}
        for name, p in actors.items():
            if name.startswith(("prefill", "decode", "split")):
                with contextlib.suppress(Exception):  # killed meanwhile
                    worker_tasks[name] = p.call_on(loop_tasks)
        migrations = soak_mix.router_migrations(cluster)
        if memray_path is not None:
            memray_leaks = memray_growth(memray_path)
        for name, p in actors.items():
            with contextlib.suppress(Exception):  # killed meanwhile
                periodic[name] = p.call(periodic_trim_stats)
        if args.trim_at_end:
            for name, p in actors.items():
                try:
                    before = proc_stats.breakdown(p.pid).rss_mb
                    p.call(proc_stats.trim)
                    trimmed_to = proc_stats.breakdown(p.pid).rss_mb
                except Exception as e:  # killed meanwhile
                    print(f"{name}: not trimmed ({type(e).__name__})")
                    continue
                trimmed[name] = {"rss_before_mb": before, "rss_after_mb": trimmed_to}

    report: dict[str, Any] = {
        "minutes": args.minutes,
        "env": extra_env,
        "requests": counts,
        "requests_total": sum(counts.values()),
        "max_slope_mb_h": args.max_slope_mb_h,
        "token_channels": channels,
        "events": events,
        "migrations": migrations,
        "workers_idle_before": idle_before,
        "workers_idle_after": idle_after,
        "worker_tasks_after": worker_tasks,
        "processes": {},
    }
    if memray_path is not None:
        report["memray"] = {"process": args.memray, "file": str(memray_path),
                            "alive_at_end_since_warm_up": memray_leaks}  # fmt: skip
    flat = True
    for name in procs:
        after = [(t, s[name]) for t, s in samples if t >= warm and name in s]
        if len(after) < 4:
            raise SystemExit("too few samples after the warm-up: run longer or sample more often")
        times = [t for t, _ in after]
        first, last = after[0][1], after[-1][1]
        row: dict[str, Any] = {
            "rss_start_mb": next(s[name] for _, s in samples if name in s)["rss_mb"],
            "rss_warm_mb": first["rss_mb"],
            "rss_end_mb": last["rss_mb"],
        }
        for key in ("rss_mb", "anon_mb", "heap_mb", "anon_maps_mb", "file_mb"):
            row[f"slope_{key.removesuffix('_mb')}_mb_h"] = round(
                slope_mb_per_h(times, [s[key] for _, s in after]), 1
            )
        row["slope_rss_stderr_mb_h"] = round(
            slope_stderr_mb_per_h(times, [s["rss_mb"] for _, s in after]), 1
        )
        row["threads"] = [first.get("threads"), last.get("threads")]
        row["fds"] = [first.get("fds"), last.get("fds")]
        if first.get("malloc") and last.get("malloc"):
            row["malloc_warm"], row["malloc_end"] = first["malloc"], last["malloc"]
            row["slope_malloc_in_use_mb_h"] = round(
                slope_mb_per_h(times, [s["malloc"]["in_use"] for _, s in after]), 1
            )
        for key in ("traced_mb", "tracemalloc_own_mb"):
            if all(key in s for _, s in after):
                row[f"slope_{key.removesuffix('_mb')}_mb_h"] = round(
                    slope_mb_per_h(times, [s[key] for _, s in after]), 2
                )
        if all("tracemalloc_own_mb" in s for _, s in after):  # the process's own RSS
            own = [s["rss_mb"] - s["tracemalloc_own_mb"] for _, s in after]
            row["slope_rss_less_tracemalloc_mb_h"] = round(slope_mb_per_h(times, own), 1)
            row["slope_rss_less_tracemalloc_stderr_mb_h"] = round(
                slope_stderr_mb_per_h(times, own), 1
            )
        if name in maps_warm and name in maps_end:
            row["grown_mappings"] = grown_mappings(maps_warm[name], maps_end[name])
        if name in objs_warm:
            row["grown_objects"] = grown_objects(objs_warm[name], objs_end[name])
        if name in traced:
            row["tracemalloc_growth"] = traced[name]
        if name in trimmed:
            row["malloc_trim"] = trimmed[name]
        if periodic.get(name):
            row["periodic_malloc_trim"] = periodic[name]
        row["flat"] = row["slope_rss_mb_h"] <= args.max_slope_mb_h
        flat &= row["flat"]
        report["processes"][name] = row
    report["flat"] = flat
    report["samples"] = [(round(t, 1), {k: v["rss_mb"] for k, v in s.items()}) for t, s in samples]
    report["warm_s"] = warm
    text = json.dumps(report, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    print(f"\n{report['requests_total']} requests in {args.minutes:g} min; flat: RSS slope "
          f"after the first third <= {args.max_slope_mb_h:g} MB/h\n{table(report)}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(text)
    if args.plot is not None:
        from benchmarks.suites import soak_plot

        soak_plot.plot(report, args.plot)
    raise SystemExit(0 if flat else 1)
