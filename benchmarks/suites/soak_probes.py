"""What the soak (benchmarks/suites/soak.py) runs inside the cluster's actors: tracemalloc's
heap and its growth sites, memray's native allocations, the router's token channels, Python
object counts. The soak ships this module by value (`ray.cloudpickle`), so its globals do not
last from call to call: what one call leaves for the next lives in an imported module."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def start_tracemalloc(frames: int) -> None:
    import tracemalloc

    tracemalloc.start(frames)


def traced_mb() -> dict[str, float]:
    """The Python heap tracemalloc traces now, and what tracemalloc itself takes (part of
    the RSS: subtract it to read the process's own)."""
    import tracemalloc

    if not tracemalloc.is_tracing():
        return {}
    return {"traced_mb": tracemalloc.get_traced_memory()[0] / 2**20,
            "tracemalloc_own_mb": tracemalloc.get_tracemalloc_memory() / 2**20}  # fmt: skip


_TRACED_AT_WARM = "_pdserve_soak_warm"
"""Where in the tracemalloc module an actor keeps its end-of-warm-up statistics between two
calls (this module travels by value: its own globals do not last from call to call)."""


def _traced_by_site() -> dict[tuple[str, ...], tuple[int, int]]:
    import tracemalloc

    own = [tracemalloc.Filter(False, "*/soak*.py"), tracemalloc.Filter(False, tracemalloc.__file__)]
    stats = tracemalloc.take_snapshot().filter_traces(own).statistics("traceback")
    out = {}
    for s in stats:  # a Traceback iterates from its oldest frame: innermost first here
        key = tuple(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in s.traceback)[::-1]
        out[key] = (s.size, s.count)
    return out


def traced_at_warm() -> None:
    """Keep the Python heap's size by allocation site (traceback) at the end of the warm-up:
    the aggregate only, not the snapshot (which would hold a tuple per live block)."""
    import tracemalloc

    setattr(tracemalloc, _TRACED_AT_WARM, _traced_by_site())


def traced_growth(top: int = 10) -> list[str]:
    """The allocation sites whose live Python memory grew most since `traced_at_warm`
    (innermost frame first), largest first; tracemalloc stops."""
    import tracemalloc

    before = getattr(tracemalloc, _TRACED_AT_WARM, {})
    after = _traced_by_site()
    tracemalloc.stop()
    grown = []
    for key in before.keys() | after.keys():
        (s0, n0), (s1, n1) = before.get(key, (0, 0)), after.get(key, (0, 0))
        grown.append((s1 - s0, n1 - n0, key))
    grown.sort(reverse=True)
    total = sum(d for d, _, _ in grown) / 2**20
    out = [f"net {total:+.2f} MB over {len(after)} sites"]
    for size, count, key in grown[:top]:
        if size > 0:
            out.append(f"{size / 2**20:+.3f} MB {count:+d} blocks: " + " < ".join(key))
    return out


def start_memray(path: str) -> None:
    """Track every allocation of this process (native stacks; aggregated in memory, so the
    file stays small) from now until `stop_memray`."""
    import memray

    tracker = memray.Tracker(path, native_traces=True,
                             file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)  # fmt: skip
    tracker.__enter__()
    memray._pdserve_soak_tracker = tracker


def stop_memray() -> None:
    import memray

    memray._pdserve_soak_tracker.__exit__(None, None, None)


def memray_growth(path: Path, top: int = 10) -> list[str]:
    """What the memray-tracked process allocated while tracked and still held when the
    tracking stopped, by native and Python stack, largest first."""
    import memray

    records = list(memray.FileReader(str(path)).get_leaked_allocation_records(merge_threads=True))
    records.sort(key=lambda r: r.size, reverse=True)
    out = [f"total {sum(r.size for r in records) / 2**20:.2f} MB in "
           f"{sum(r.n_allocations for r in records)} allocations"]  # fmt: skip
    for r in records[:top]:
        py = [f"{fn} {file.rsplit('/', 1)[-1]}:{line}" for fn, file, line in r.stack_trace(4)]
        native = [fn.split("(")[0][:60] for fn, _, _ in r.native_stack_trace(6)]
        out.append(f"{r.size / 2**20:.2f} MB {r.n_allocations} allocs: "
                   f"{' < '.join(py) or '-'} | native {' < '.join(native)}")  # fmt: skip
    return out


def channel_stats(router: Any) -> dict[str, dict[str, int]]:
    """A router actor's token channels (router/decode_channel.py): decode worker id ->
    batches carried, subscriptions made, subscriptions draining, requests open."""
    out = {}
    for worker_id, entry in router.server.view.entries.items():
        ch = entry.channel
        if ch is not None:
            out[worker_id] = {"batches": ch.num_batches, "subscriptions": ch.num_subscriptions,
                              "draining": ch.num_draining, "open": ch.num_open}  # fmt: skip
    return out


def periodic_trim_stats() -> dict[str, float]:
    """What this actor's periodic `malloc_trim` (vocabulary/malloc_trim.py) did: trims,
    MB of RSS they took back, the longest; empty when it does not run."""
    from dataclasses import asdict

    from vocabulary.malloc_trim import trim_stats

    stats = trim_stats()
    return {} if stats is None else {k: round(v, 2) for k, v in asdict(stats).items()}


def object_counts() -> dict[str, int]:
    """Live Python objects of this process by type name (gc-tracked ones)."""
    import gc

    gc.collect()
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        counts[name] = counts.get(name, 0) + 1
    return counts


def stream_generators(router: Any) -> dict[str, Any]:
    """The router's live Ray streaming generators (each holds, natively, the ids of every item
    its call yielded until it is deleted): how many, how many a token-channel subscription
    holds now, and the types of what refers to the others."""
    import gc

    from ray import ObjectRefGenerator

    gc.collect()
    held = {id(sub.call) for e in router.server.view.entries.values() if e.channel is not None
            for sub in e.channel._subscriptions()}  # fmt: skip
    # type(), not isinstance: isinstance over every object wakes torch's deprecated attributes
    live = [o for o in gc.get_objects() if type(o) is ObjectRefGenerator]
    referrers: dict[str, int] = {}

    def count(name: str) -> None:
        referrers[name] = referrers.get(name, 0) + 1

    for gen in live:
        if id(gen) not in held:
            for r in gc.get_referrers(gen):
                if r is live:
                    continue
                if type(r).__name__ == "frame":
                    count(f"frame {r.f_code.co_name}")
                    continue
                count(type(r).__qualname__)
                for rr in gc.get_referrers(r):  # what holds the Subscription
                    if rr is not live and type(rr).__name__ != "frame":
                        count(f"{type(r).__qualname__} < {type(rr).__qualname__}")
                    elif type(rr).__name__ == "frame":
                        count(f"{type(r).__qualname__} < frame {rr.f_code.co_name}")
    return {"live": len(live), "held": sum(id(g) in held for g in live), "referrers": referrers}


def loop_tasks(actor: Any) -> dict[str, list[str]]:
    """The asyncio tasks on a worker actor's loop, each named by the chain of coroutines it
    awaits (a Ray streaming method call reads `... > execute_streaming_generator_async`: the
    token channel a router keeps open on a decode worker), without the probe's own task; and
    the process's thread names (`ThreadPoolExecutor-0_0`: the loop's default executor, started
    at its first `run_in_executor`). Run it on the actor's loop (soak.py `on_actor_loop`)."""
    import asyncio
    import threading

    loop = actor.runtime._loop
    names = []
    for task in asyncio.all_tasks(loop):
        if task is asyncio.current_task(loop):
            continue
        chain, coro = [], task.get_coro()
        while coro is not None and len(chain) < 8:
            chain.append(getattr(coro, "__qualname__", type(coro).__name__).split(".")[-1])
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        names.append(" > ".join(chain))
    return {"tasks": sorted(names), "threads": sorted(t.name for t in threading.enumerate())}
