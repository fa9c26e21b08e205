"""The titled steps of the long GPU suites (engine, engine_step, fp8, lora, kv_transfer): each
step prints what it does, catches its own failure (one failure loses nothing else) and may add
rows to one closing table of what was measured, against what, and the ratio; and the
time-stamped progress lines of the cluster suites (goodput, host_tier)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from benchmarks.harness.table import Table

T = TypeVar("T")


def progress(msg: str) -> None:
    """One progress line, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Row:
    """One line of the closing table. `reference` is what the figure is compared with,
    measured in the same run (a floor derived from the HBM copy or matmul row, another
    engine's rate); the rows of those measurements name what they are the reference for."""

    what: str
    measured: str
    reference: str = ""
    ratio: str = ""


class StepLog:
    """Steps run in order, each announced and timed; the rows they added, printed last."""

    def __init__(self, hint: Callable[[BaseException], str | None] | None = None) -> None:
        self.rows: list[Row] = []
        self._hint = hint
        """What to print under a failure (e.g. the UCX settings when NIXL failed), if
        anything."""

    def step(self, title: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None when it raised (its traceback printed, a FAILED row added)."""
        print(f"\n== {title}", flush=True)
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:
            traceback.print_exc()
            print(f"!! {title} FAILED after {time.perf_counter() - t0:.1f} s", flush=True)
            hint = self._hint(e) if self._hint is not None else None
            if hint:
                print(f"   hint: {hint}", flush=True)
            self.add(title, "FAILED")
            return None
        print(f"   done in {time.perf_counter() - t0:.1f} s", flush=True)
        return out

    def add(self, what: str, measured: str, reference: str = "", ratio: str = "") -> None:
        self.rows.append(Row(what, measured, reference, ratio))

    def table(self) -> Table:
        rows = [(r.what, r.measured, r.reference, r.ratio) for r in self.rows]
        return Table.of(("what", "measured", "reference", "ratio"), rows)

    def print_table(self) -> None:
        print("\n" + "=" * 104)
        print(self.table().plain())


def run_steps(
    on_cpu: bool,
    cpu_title: str,
    cpu_main: Callable[[StepLog], None],
    gpu_main: Callable[[StepLog], None],
) -> None:
    """A suite's whole run: its CPU step (`on_cpu`) or its GPU steps, timed, then the table."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = StepLog()
    t0 = time.perf_counter()
    if on_cpu:
        log.step(cpu_title, lambda: cpu_main(log))
    else:
        gpu_main(log)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    log.print_table()
