"""An idle worker actor leaves the CPU to others: engine, transfer and publisher threads all
sleep between timer ticks when there is no work."""

from __future__ import annotations

import time

import pytest
import ray
from pd_client import wait_idle
from workers_harness import Workers

pytestmark = pytest.mark.timeout(120)

WINDOW_S = 3.0


def is_spinning(cpu_s: float, voluntary_switches: int) -> bool:
    """A thread that ran (over 5% of a core) and almost never went to sleep on its own.

    Load-independent, unlike CPU shares: on the shared 2-core machine a spinning thread may
    get only a fifth of a core, but it never blocks; every timer-driven thread of a worker
    (engine, transfer, publisher, Ray's) sleeps between ticks.
    """
    return cpu_s > 0.05 * WINDOW_S and voluntary_switches < WINDOW_S


def test_no_thread_of_an_idle_worker_actor_spins(workers: Workers) -> None:
    actors = {"p0": workers.p0, "d0": workers.d0}
    wait_idle(*actors.values())

    def thread_stats(_self: object) -> dict[str, tuple[int, int]]:  # runs in the actor
        """Per thread: (ns on a CPU, voluntary context switches)."""
        import os

        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    on_cpu_ns = int(f.read().split()[0])
                with open(f"/proc/self/task/{tid}/status") as f:
                    status = dict(line.split(":", 1) for line in f.read().splitlines())
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue  # the thread ended
            out[f"{tid}:{name}"] = (on_cpu_ns, int(status["voluntary_ctxt_switches"]))
        return out

    def sample() -> dict[str, dict[str, tuple[int, int]]]:
        refs = {n: a.__ray_call__.remote(thread_stats) for n, a in actors.items()}
        return {n: ray.get(ref, timeout=30) for n, ref in refs.items()}

    before = sample()
    time.sleep(WINDOW_S)
    after = sample()
    spinning = {}
    for n in actors:
        for thread, (cpu_ns, switches) in after[n].items():
            if thread not in before[n]:
                continue
            cpu_s = (cpu_ns - before[n][thread][0]) / 1e9
            voluntary = switches - before[n][thread][1]
            if is_spinning(cpu_s, voluntary):
                spinning[f"{n}/{thread}"] = (round(cpu_s, 2), voluntary)
    assert not spinning, f"threads spinning while idle (CPU s, voluntary switches): {spinning}"
