"""The soak's report (benchmarks/suites/soak.py): the slope and its standard error, the Python
allocation sites that grew between the end of the warm-up and the end (tracemalloc, the
soak's own allocations left out), the table, and the plot (a process replaced mid-run
drawn from when it came)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.suites import soak, soak_plot, soak_probes

KEPT: list[bytes] = []


def _grow(n: int) -> None:
    KEPT.extend(bytes(1000) for _ in range(n))


def test_a_steady_rise_has_its_slope_and_a_flat_line_none() -> None:
    times = [60.0 * i for i in range(61)]  # an hour, a sample a minute
    rising = [100.0 + 10.0 * t / 3600 + (0.5 if i % 2 else -0.5) for i, t in enumerate(times)]
    assert abs(soak.slope_mb_per_h(times, rising) - 10.0) < 0.1
    assert 0 < soak.slope_stderr_mb_per_h(times, rising) < 0.5
    assert soak.slope_mb_per_h(times, [100.0] * len(times)) == 0.0
    assert soak.slope_stderr_mb_per_h(times, [100.0] * len(times)) == 0.0


def test_traced_growth_names_the_site_that_kept_memory_since_the_warm_up() -> None:
    soak_probes.start_tracemalloc(4)
    _grow(100)  # during the warm-up: not growth
    soak_probes.traced_at_warm()
    _grow(2000)
    lines = soak_probes.traced_growth(top=3)
    KEPT.clear()
    assert lines[0].startswith("net +")
    top = lines[1]
    assert "+2000 blocks" in top, lines
    assert top.split(": ", 1)[1].startswith("test_soak_report.py:"), lines  # innermost first
    assert not any("soak.py:" in line.split(": ", 1)[-1].split(" < ")[0] for line in lines[1:])


def _report() -> dict[str, Any]:
    row = {"rss_start_mb": 300.0, "rss_warm_mb": 310.0, "rss_end_mb": 311.0,
           "slope_rss_mb_h": 0.4, "slope_rss_stderr_mb_h": 0.2, "flat": True}  # fmt: skip
    traced = {**row, "slope_rss_less_tracemalloc_mb_h": -0.3,
              "slope_rss_less_tracemalloc_stderr_mb_h": 0.2, "slope_malloc_in_use_mb_h": 0.1,
              "slope_traced_mb_h": 0.05}  # fmt: skip
    samples = [(60.0 * i, {"router-0": 310.0 + 0.01 * i, "decode-1": 400.0}) for i in range(6)]
    samples += [(60.0 * i, {"router-0": 310.0, "decode-3": 405.0}) for i in range(6, 12)]
    return {"processes": {"router-0": traced, "decode-3": {**row, "flat": False}},
            "samples": samples, "warm_s": 240.0,
            "events": [[330.0, "killed decode-1; replaced by ['decode-3']"]]}  # fmt: skip


def test_the_table_shows_what_was_measured_and_a_dash_for_what_was_not() -> None:
    lines = soak.table(_report()).splitlines()
    router = next(line for line in lines if line.startswith("| router-0"))
    decode = next(line for line in lines if line.startswith("| decode-3"))
    assert "+0.4 ± 0.2 | -0.3 ± 0.2 | +0.1 | +0.1 | yes" in router
    assert "+0.4 ± 0.2 | - | - | - | **no**" in decode


def test_the_plot_draws_every_process_also_one_that_came_mid_run(tmp_path: Path) -> None:
    src = tmp_path / "soak.json"
    src.write_text(json.dumps(_report()))
    out = tmp_path / "soak.png"
    soak_plot.main([str(src), str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
