"""What a process has used: its CPU seconds (/proc/PID/stat), where its memory is (a
breakdown of its mappings, /proc/PID/smaps) and, read from inside the process, glibc malloc's
own account (`mallinfo2`).

The router and workers suites charge CPU seconds to a path; the soak (benchmarks/suites/soak.py)
samples the memory per process to tell a leak (memory in use that keeps growing) from
allocator behaviour (free memory glibc keeps in its heaps and arenas, which `malloc_trim(0)`
hands back) from native mappings that grow (UCX, gRPC, Ray buffers). The soak ships this
module's functions to its actors by value (`ray.cloudpickle.register_pickle_by_value`).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class MemoryBreakdown:
    """One process's resident memory by kind of mapping (MB) and its thread count."""

    rss_mb: float
    anon_mb: float
    """Anonymous resident memory (private heap, arenas, mmaps, stacks)."""
    heap_mb: float
    """The main arena's `[heap]` (brk) mapping."""
    anon_maps_mb: float
    """Unnamed anonymous mappings: glibc's thread arenas (64 MiB reservations), large
    malloc'd blocks (mmap), native libraries' own pools."""
    file_mb: float
    """File-backed resident memory (code and data of the libraries, mapped files)."""
    threads: int
    mappings: int
    fds: int = 0
    """Open file descriptors (/proc/PID/fd), a count that must not grow under steady load."""


def mappings(pid: int) -> dict[str, tuple[float, float]]:
    """Every mapping of `pid` as "start perms name" -> (size MB, resident MB) (keyed by its
    start: a glibc arena grows in place, its end moves)."""
    out: dict[str, tuple[float, float]] = {}
    key, size = "", 0.0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEADER.match(line)
            if m is not None:
                key = f"{m.group(1)} {m.group(3)} {m.group(4).strip()}"
                size = (int(m.group(2), 16) - int(m.group(1), 16)) / 2**20
                out[key] = (size, 0.0)
            elif line.startswith("Rss:"):
                out[key] = (size, int(line.split()[1]) / 1024)
    return out


def breakdown(pid: int) -> MemoryBreakdown:
    """`pid`'s memory by kind (reads /proc/PID/smaps and status; a few ms)."""
    rss = anon = heap = anon_maps = file = 0.0
    maps = mappings(pid)
    for key, (_, res) in maps.items():
        name = key.split(" ", 2)[2]
        rss += res
        if name == "[heap]":
            heap += res
            anon += res
        elif name == "":
            anon_maps += res
            anon += res
        elif name.startswith("["):  # stacks, vdso, vvar
            anon += res
        else:
            file += res
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return MemoryBreakdown(
        round(rss, 1),
        round(anon, 1),
        round(heap, 1),
        round(anon_maps, 1),
        round(file, 1),
        threads,
        len(maps),
        _num_fds(pid),
    )


def _num_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # gone, or not ours to read
        return 0


def malloc_stats() -> dict[str, float]:
    """glibc malloc's account of this process (MB), summed over every arena: `heap` (got from
    the system with brk/arenas), `mmapped` (large blocks), `in_use` and `free` (held by malloc,
    not returned). Empty when malloc is not glibc's (e.g. jemalloc preloaded)."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        if "jemalloc" in f.read():
            return {}
    fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
              "fordblks", "keepcost")  # fmt: skip

    class MallInfo2(ctypes.Structure):  # here, not global: the soak ships this function by value
        _fields_ = [(name, ctypes.c_size_t) for name in fields]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = MallInfo2
    info = fn()
    mb = 2**20
    return {
        "heap": round(info.arena / mb, 1),
        "mmapped": round(info.hblkhd / mb, 1),
        "in_use": round(info.uordblks / mb, 1),
        "free": round(info.fordblks / mb, 1),
        "arenas": arena_count(),
    }


def arena_count() -> int:
    """Arenas glibc malloc made in this process (main + one per thread contention, up to
    8 x cores by default): counted from `malloc_info`'s XML."""
    libc = ctypes.CDLL("libc.so.6")
    buf = ctypes.c_char_p()
    size = ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    return text.count("<heap nr=")


def trim() -> None:
    """Hand the free memory at the top of every arena and whole free pages back (glibc)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


JEMALLOC = "/lib/x86_64-linux-gnu/libjemalloc.so.2"
"""Debian's libjemalloc2 (built with heap profiling)."""


def jemalloc_profile_env(prefix: str, lg_sample: int = 17) -> dict[str, str]:
    """Environment that runs a process under jemalloc with heap profiling on (one sample per
    2**lg_sample bytes allocated, on average); `heap_dump` writes its profile."""
    conf = f"prof:true,prof_prefix:{prefix},lg_prof_sample:{lg_sample}"
    return {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": conf}


def heap_dump(path: str) -> bool:
    """Write jemalloc's heap profile of this process to `path` (read it with `jeprof`,
    `--base` another dump to see what grew between the two); False without jemalloc
    profiling."""
    import ctypes

    name = ctypes.c_char_p(path.encode())
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except AttributeError:
        return False
    return bool(mallctl(b"prof.dump", None, None, ctypes.byref(name), ctypes.sizeof(name)) == 0)
