"""vocabulary/malloc_trim.py: the periodic trim every process of a cluster runs, read from the
environment the cluster gives its actors."""

from __future__ import annotations

import ctypes
import itertools
import time

import pytest

from vocabulary import malloc_trim
from vocabulary.malloc_trim import (
    ARENA_ENV,
    DEFAULT_INTERVAL_S,
    TRIM_ENV,
    MallocTrimmer,
    interval_from_env,
    malloc_trim_env,
)


def test_the_interval_comes_from_the_environment_the_cluster_sets() -> None:
    assert interval_from_env({}) == DEFAULT_INTERVAL_S
    assert interval_from_env(malloc_trim_env(2.5)) == 2.5
    assert interval_from_env(malloc_trim_env(0)) == 0
    for bad in ("-1", "often", "nan"):
        with pytest.raises(ValueError, match=f"{TRIM_ENV}='{bad}': seconds between trims"):
            interval_from_env({TRIM_ENV: bad})


def test_the_arena_cap_is_in_the_environment_only_when_set() -> None:
    assert ARENA_ENV not in malloc_trim_env(60)
    assert malloc_trim_env(60, 2) == {TRIM_ENV: "60.0", ARENA_ENV: "2"}
    with pytest.raises(ValueError, match="arena_max: >= 0"):
        malloc_trim_env(60, -1)


def test_off_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc_trim, "_trimmer", None)
    assert malloc_trim.start_malloc_trim("test", malloc_trim_env(0)) is None
    assert malloc_trim.trim_stats() is None


def test_the_thread_trims_at_its_interval_and_hands_freed_pages_back() -> None:
    calls: list[float] = []
    real = malloc_trim._glibc_trim()
    assert real is not None, "these machines run glibc"

    def trim() -> object:
        calls.append(time.monotonic())
        return real()

    # memory malloc keeps after a free: many small blocks (below the mmap threshold) freed
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(800)]  # 50 MB
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)  # resident
    keep = blocks[-1]  # holds the heap's top, so only a trim of the middle gives pages back
    for b in blocks[:-1]:
        libc.free(b)
    trimmer = MallocTrimmer(0.05, trim)
    trimmer.start()
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        trimmer.stop()
        libc.free(keep)
    assert len(calls) >= 3 and trimmer.stats.trims == len(calls)
    assert all(b - a >= 0.04 for a, b in itertools.pairwise(calls))
    assert trimmer.stats.released_mb > 20  # the freed 50 MB went back, not only the top
    assert 0 < trimmer.stats.longest_ms < 1000


def test_a_failing_trim_stops_the_thread_not_the_process(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> object:
        raise OSError("no")

    trimmer = MallocTrimmer(0.01, broken)
    trimmer.start()
    trimmer._thread.join(timeout=5)
    assert not trimmer._thread.is_alive()
    assert "malloc_trim failed" in caplog.text
