"""Give glibc malloc's free pages back to the system at a steady interval, in every process a
cluster starts.

Why: glibc keeps what a long-running process frees inside its heaps and per-thread arenas, to
hand it out again; it returns memory only from the top of a heap, and only once the free top
passes a threshold. A server whose threads allocate and free in a shifting pattern (gRPC's
and Ray's threads, per-request buffers) holds more and more free pages in the middle of its
arenas: the 100-minute soak measured the router's RSS +2.9 MB/h of which malloc's free bytes
were +2.4 MB/h (docs/benchmarks.md, "Soak"). `malloc_trim(0)` hands every whole free page of
every arena back (`madvise(MADV_DONTNEED)`; glibc 2.8+), which bounds that part of RSS to
what the process frees between two trims.

`start_malloc_trim(role)` starts one daemon thread per process (a later call keeps it) that
calls `malloc_trim(0)` every `PDSERVE_MALLOC_TRIM_S` seconds (default 60; 0 turns it off).
deploy/control/launch.py puts the cluster's `cluster.malloc_trim_s` into every actor's
environment (`malloc_trim_env`); the controller, the routers, the workers and their
tensor-parallel ranks call `start_malloc_trim` when they start. A trim holds each arena's lock
while it walks it (well under a millisecond for the heaps measured; the thread records the
longest), so a thread that allocates in that arena waits that long at most. Where malloc is
not glibc's (musl, jemalloc preloaded) nothing starts and the process says so once at INFO.

The same environment caps glibc's arenas (`MALLOC_ARENA_MAX`, `cluster.malloc_arena_max`,
default 2; glibc's own default is 8 per core): with a trim every minute the router's RSS still
grew +1.4 MB/h over two hours, most of it two arena mappings growing (+1.3 and +0.9 MB) while
malloc's bytes in use grew +0.5 MB/h; every thread that finds its arena locked makes another,
each keeping its own free fragments. Fewer arenas hold fewer fragments. glibc reads the
variable once, when the process starts (Ray starts each actor's process with its runtime
environment), so it is set, never applied later.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

TRIM_ENV = "PDSERVE_MALLOC_TRIM_S"
ARENA_ENV = "MALLOC_ARENA_MAX"
DEFAULT_INTERVAL_S = 60.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


def malloc_trim_env(interval_s: float, arena_max: int = 0) -> dict[str, str]:
    """What the cluster puts in each actor's environment for a trim every `interval_s` and at
    most `arena_max` malloc arenas (0: glibc's default, the variable left out)."""
    if arena_max < 0:
        raise ValueError(f"arena_max: >= 0 (0: glibc's default), got {arena_max}")
    env = {TRIM_ENV: repr(float(interval_s))}
    if arena_max:
        env[ARENA_ENV] = str(arena_max)
    return env


def interval_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The interval `PDSERVE_MALLOC_TRIM_S` asks for (0: off); raises ValueError naming the
    variable when it is not a number >= 0."""
    env = os.environ if environ is None else environ
    raw = env.get(TRIM_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{TRIM_ENV}={raw!r}: seconds between trims, a number >= 0 (0: off)")
    return value


@dataclass
class TrimStats:
    """What this process's trims did so far."""

    interval_s: float
    trims: int = 0
    released_mb: float = 0.0
    """RSS the trims took back (resident pages before minus after each, summed; other threads
    allocate meanwhile, so it is a lower bound)."""
    longest_ms: float = 0.0


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _glibc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)` as a callable, or None where malloc is another allocator."""
    try:
        with open("/proc/self/maps") as f:
            if "jemalloc" in f.read():
                return None
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


class MallocTrimmer:
    """The daemon thread of one process (`start_malloc_trim` makes it)."""

    def __init__(self, interval_s: float, trim: Callable[[], object]) -> None:
        self.stats = TrimStats(interval_s)
        self._trim = trim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-malloc-trim", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def trim_once(self) -> None:
        before = _resident_bytes()
        t0 = time.perf_counter()
        self._trim()
        ms = (time.perf_counter() - t0) * 1e3
        s = self.stats
        s.trims += 1
        s.released_mb += max(0, before - _resident_bytes()) / 2**20
        s.longest_ms = max(s.longest_ms, ms)

    def _run(self) -> None:
        while not self._stop.wait(self.stats.interval_s):
            try:
                self.trim_once()
            except Exception:  # never let the thread die silently, never take the process down
                log.exception("malloc_trim failed; trimming stops in this process")
                return


_trimmer: MallocTrimmer | None = None
_lock = threading.Lock()


def start_malloc_trim(role: str, environ: Mapping[str, str] | None = None) -> TrimStats | None:
    """Start this process's trim thread from its environment (once; a later call returns the
    running one's stats). None when off, or where malloc is not glibc's. A malformed
    `PDSERVE_MALLOC_TRIM_S` raises ValueError naming it (the actor fails to start, so the
    operator sees it)."""
    global _trimmer
    interval = interval_from_env(environ)
    with _lock:
        if _trimmer is not None:
            return _trimmer.stats
        if interval == 0:
            return None
        trim = _glibc_trim()
        if trim is None:
            log.info("%s: malloc is not glibc's here; no periodic malloc_trim", role)
            return None
        _trimmer = MallocTrimmer(interval, trim)
        _trimmer.start()
        return _trimmer.stats


def trim_stats() -> TrimStats | None:
    """The running trim thread's stats in this process, or None."""
    return None if _trimmer is None else _trimmer.stats
