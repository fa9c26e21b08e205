"""`python -m benchmarks split_goodput --plot OUT --from JSON...`: merges the records of
several runs of one workload by mode and rate (a rate run twice: the run with more requests),
labels partitioned modes with the SMs granted, refuses files of different workloads; `--ramp`
arrivals follow their ramp, and `--plot-split` draws the split over time of ramp runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.suites.split_goodput import (
    WORKLOADS,
    Mode,
    merged_runs,
    parse_ramp,
    plot_ramps,
    ramp_arrivals,
)

ROOT = Path(__file__).resolve().parents[3]
BALANCED = WORKLOADS["balanced"]
TWO_MODES = {"colocated:2048": {8.0: (10, 9.0), 16.0: (10, 30.0)}, "split:32": {8.0: (10, 12.0)}}


def record(i: int, rate: float, tpot_ms: float) -> dict[str, Any]:
    return {
        "request_id": f"r{i}", "index": i, "sent_s": i / rate, "scheduled_s": i / rate,
        "prompt_tokens": 1000, "max_tokens": 300, "output_tokens": 300, "e2e_ms": 3000.0,
        "ttft_ms": 50.0, "tpot_ms": tpot_ms, "itl_ms": [], "status": "OK", "offered_rate": rate,
    }  # fmt: skip


def run_file(path: Path, workload: str, modes: dict[str, dict[float, tuple[int, float]]]) -> Path:
    """A --json file: for each mode, {rate: (requests, tpot_ms)}; `split:*` modes
    partitioned 32/100."""
    w = WORKLOADS[workload]
    report = {
        "workload": {"name": w.name, "prompt_tokens": w.prompt_tokens,
                     "output_tokens": w.output_tokens, "ttft_ms": w.ttft_ms},
        "modes": {
            mode: {
                "split": {"partitioned": True, "decode_sms": 32, "prefill_sms": 100}
                if mode.startswith("split") else None,
                "records": {str(rate): [record(i, rate, tpot) for i in range(n)]
                            for rate, (n, tpot) in runs.items()},
            }
            for mode, runs in modes.items()
        },
    }  # fmt: skip
    path.write_text(json.dumps(report))
    return path


def test_runs_merge_by_mode_and_rate_keeping_the_larger_run(tmp_path: Path) -> None:
    a = run_file(tmp_path / "a.json", "balanced", TWO_MODES)
    b = run_file(tmp_path / "b.json", "balanced", {"colocated:2048": {16.0: (40, 15.0)}})
    workload, modes = merged_runs([a, b])
    assert workload == BALANCED
    assert sorted(modes) == ["colocated:2048", "split:32 (32 decode / 100 prefill SMs)"]
    coloc = modes["colocated:2048"]
    assert sorted(coloc) == [8.0, 16.0]
    assert len(coloc[16.0]) == 40 and coloc[16.0][0].tpot_ms == 15.0  # the larger run won
    assert isinstance(coloc[8.0][0].itl_ms, tuple)


def test_files_of_different_workloads_are_refused(tmp_path: Path) -> None:
    a = run_file(tmp_path / "a.json", "balanced", {"split:32": {8.0: (4, 10.0)}})
    b = run_file(tmp_path / "b.json", "decode_heavy", {"split:32": {8.0: (4, 10.0)}})
    with pytest.raises(SystemExit, match="workload decode_heavy, the others balanced"):
        merged_runs([a, b])


def test_the_door_writes_the_plot_without_running_anything(tmp_path: Path) -> None:
    a = run_file(tmp_path / "a.json", "balanced", TWO_MODES)
    out = tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "split_goodput", "--plot", str(out),
         "--modes", "split:32", "--from", str(a)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in done.stdout


def test_ramp_arrivals_follow_the_ramp() -> None:
    times = ramp_arrivals(1.0, 21.0, 40.0, seed=3)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 40.0
    assert 0.85 * 440 < len(times) < 1.15 * 440  # the ramp's integral: (1 + 21) / 2 * 40
    first, last = sum(t < 10 for t in times), sum(t >= 30 for t in times)
    assert last > 3 * first  # rate 1-6 in the first quarter, 16-21 in the last
    assert ramp_arrivals(1.0, 21.0, 40.0, seed=3) == times  # seeded


@pytest.mark.parametrize("text", ["1:2", "a:2:3", "1:2:0", "-1:2:5", "0:0:5"])
def test_a_bad_ramp_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(SystemExit, match="--ramp"):
        parse_ramp(text)


def test_the_split_over_time_is_plotted_from_ramp_runs(tmp_path: Path) -> None:
    records = [record(i, 4.0, 10.0 + i) for i in range(8)]
    history = [[0.0, 64, 68], [1.5, 132, 132], [3.0, 32, 100]]
    run = {"ramp": [1.0, 8.0, 4.0], "records": records, "history": history}
    path = tmp_path / "ramp.json"
    path.write_text(json.dumps({"workload": {}, "modes": {"split:0": {"ramp": run}}}))
    out = tmp_path / "split.png"
    plot_ramps([path], out)
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit, match="no --ramp run"):
        plot_ramps([run_file(tmp_path / "a.json", "balanced", TWO_MODES)], out)


def test_a_mode_names_its_engine_config() -> None:
    from engine.config import EngineConfig, EngineMode

    base = EngineConfig(model_dir="unused")
    colocated = Mode("colocated:1024").engine_config(base)
    assert colocated.mode is EngineMode.COLOCATED and colocated.max_num_batched_tokens == 1024
    fixed = Mode("split:32").engine_config(base)
    assert fixed.mode is EngineMode.SPLIT and fixed.split_decode_sms == 32
    assert fixed.split_tpot_target_ms == base.split_tpot_target_ms
    loose = Mode("split:0@40").engine_config(base)
    assert loose.split_decode_sms == 0 and loose.split_tpot_target_ms == 40.0
    with pytest.raises(ValueError, match="split:DECODE_SMS"):
        Mode("pd:1").engine_config(base)
