"""The replay harness: a recorded trace goes through the same core and prints its decisions."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner.core import PlannerConfig, Role, RoleBounds, TickInput
from planner.replay import (
    TraceError,
    TraceWriter,
    config_from_json,
    config_to_json,
    config_with_overrides,
    main,
    read_trace,
    replay,
    tick_from_json,
    tick_to_json,
)

TRACE = Path(__file__).parents[2] / "data" / "planner_trace.jsonl"

EXPECTED = """\
tick 0: prefill: hold (TTFT p90 300 ms) | decode: hold (TPOT p90 20 ms)
tick 1: prefill: +1 (TTFT p90 980 ms > SLO 500 ms) | decode: hold (TPOT p90 22 ms)
tick 2: prefill: hold (cooldown: changed at tick 1) | decode: hold (TPOT p90 25 ms)
tick 3: prefill: hold (TTFT p90 450 ms; no scale-down: TTFT p90 450 ms >= 0.5 x SLO, queue 1, \
a worker is warming up) | decode: +1 (TPOT p90 87 ms > SLO 50 ms)
tick 4: prefill: hold (TTFT p90 300 ms; no scale-down: TTFT p90 300 ms >= 0.5 x SLO, queue 1, \
a worker is warming up) | decode: hold (cooldown: changed at tick 3)
tick 5: prefill: hold (TTFT p90 310 ms; no scale-down: TTFT p90 310 ms >= 0.5 x SLO) | \
decode: +1 (rate match: 4000 tok/s needs 3 workers at 70% of 2000 tok/s)
tick 6: prefill: drain p1 (slack: TTFT p90 110 ms, queue 0) | decode: hold (cooldown: changed at \
tick 5)
tick 7: prefill: hold (cooldown: changed at tick 6) | decode: hold (TPOT p90 11 ms; no scale-down: \
a worker is warming up)
tick 8: prefill: stop p1 (p1 drained, no in-flight work: stop; TTFT p90 100 ms) | decode: drain d2 \
(slack: TPOT p90 11 ms, queue 0)
tick 9: prefill: +1 (queue 12 > 8 per worker) | decode: hold (cooldown: changed at tick 8)
"""


def test_recorded_trace_replays_to_the_recorded_story() -> None:
    out = io.StringIO()
    assert main([str(TRACE)], out=out) == 0
    assert out.getvalue() == EXPECTED


def test_replay_yields_structured_decisions_with_threaded_memory() -> None:
    trace = read_trace(TRACE)
    assert trace.config is not None and trace.config.cooldown_ticks == 2
    assert len(trace.ticks) == 10
    decisions = list(replay(trace.ticks, trace.config))
    adds = [(d.prefill.add, d.decode.add) for d in decisions]
    assert adds == [(0, 0), (1, 0), (0, 0), (0, 1), (0, 0), (0, 1), (0, 0), (0, 0), (0, 0), (1, 0)]
    assert decisions[6].prefill.drain == ("p1",)
    assert decisions[8].prefill.stop == ("p1",) and decisions[8].decode.drain == ("d2",)
    assert decisions[-1].memory.last_change(Role.DECODE) == 8


def test_cold_start_samples_in_the_trace_are_excluded() -> None:
    # At tick 3 worker p1 (15 s old) reported 1400 ms TTFTs; counted, they would force a scale-up.
    trace = read_trace(TRACE)
    assert trace.config is not None
    tick3 = trace.ticks[3]
    assert max(s.value_ms for s in tick3.ttft_samples) == 1400.0
    no_cold = replace(trace.config, cold_start_s=0.0)
    assert next(replay([tick3], trace.config)).prefill.add == 0
    assert next(replay([tick3], no_cold)).prefill.add == 1


def test_config_file_overrides_fields_of_the_recorded_config(tmp_path: Path) -> None:
    config = tmp_path / "planner.json"
    config.write_text(json.dumps({"ttft_slo_ms": 5000.0, "prefill": {"max_workers": 1}}))
    out = io.StringIO()
    main([str(TRACE), "--config", str(config)], out=out)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("tick 1: prefill: hold (TTFT p90 980 ms) |")
    assert lines[9].startswith("tick 9: prefill: hold (queue 12 > 8 per worker; at max 1)")


def test_overrides_merge_role_bounds_field_by_field() -> None:
    base = PlannerConfig(prefill=RoleBounds(2, 6))
    merged = config_with_overrides(base, {"prefill": {"max_workers": 9}, "max_step": 3})
    assert merged == replace(base, prefill=RoleBounds(2, 9), max_step=3)


def test_trace_writer_round_trips_ticks_and_config() -> None:
    trace = read_trace(TRACE)
    assert trace.config is not None
    buffer = io.StringIO()
    writer = TraceWriter(buffer, trace.config)
    for tick in trace.ticks:
        writer.write(tick)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert config_from_json(lines[0]["planner_config"]) == trace.config
    assert tuple(tick_from_json(d) for d in lines[1:]) == trace.ticks


def test_config_json_keeps_role_bounds() -> None:
    config = PlannerConfig(prefill=RoleBounds(2, 6), decode_capacity_tokens_per_s=900.0)
    assert config_from_json(config_to_json(config)) == config


def test_bad_trace_lines_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    good_line = json.dumps(tick_to_json(read_trace(TRACE).ticks[0]))
    bad.write_text(good_line + "\n\n" + json.dumps({"now_s": 1.0}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:3: tick: 'tick'"):
        read_trace(bad)
    bad.write_text(json.dumps({"planner_config": {"ttft_slo": 1}}) + "\n")
    with pytest.raises(TraceError, match="unknown fields"):
        read_trace(bad)
    bad.write_text("{not json\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        read_trace(bad)


def test_tick_json_defaults_optional_fields() -> None:
    tick = tick_from_json({"tick": 1, "now_s": 2.0})
    assert tick == TickInput(1, 2.0, (), ())


def test_replay_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "planner.replay", str(TRACE)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout == EXPECTED
