"""Replay a recorded planner trace through the same pure core, offline.

A trace is JSONL: an optional first line `{"planner_config": {...}}` (fields of PlannerConfig,
role bounds as `{"prefill": {"min_workers": 1, "max_workers": 4}}`), then one TickInput per line
as written by `tick_to_json`. The controller actor records live ticks with `TraceWriter`; this
module reads them back and prints one decision per tick:

    python -m planner.replay TRACE.jsonl [--config OVERRIDES.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from planner.core import (
    LatencySample,
    PlannerConfig,
    PlannerMemory,
    RoleBounds,
    ScalingDecision,
    TickInput,
    WorkerView,
    plan,
)


class TraceError(ValueError):
    """A trace line is not a valid TickInput or config (the message names line and field)."""


def tick_to_json(tick: TickInput) -> dict[str, Any]:
    return asdict(tick)


def tick_from_json(data: dict[str, Any]) -> TickInput:
    try:
        return TickInput(
            tick=int(data["tick"]),
            now_s=float(data["now_s"]),
            prefill_workers=tuple(WorkerView(**w) for w in data.get("prefill_workers", ())),
            decode_workers=tuple(WorkerView(**w) for w in data.get("decode_workers", ())),
            ttft_samples=tuple(LatencySample(**s) for s in data.get("ttft_samples", ())),
            tpot_samples=tuple(LatencySample(**s) for s in data.get("tpot_samples", ())),
            queue_depth=int(data.get("queue_depth", 0)),
            prefill_tokens_per_s=float(data.get("prefill_tokens_per_s", 0.0)),
            decode_tokens_per_s=float(data.get("decode_tokens_per_s", 0.0)),
            arrival_rps=float(data.get("arrival_rps", 0.0)),
            mean_prompt_tokens=float(data.get("mean_prompt_tokens", 0.0)),
            mean_output_tokens=float(data.get("mean_output_tokens", 0.0)),
            ttft_percentile_ms=data.get("ttft_percentile_ms"),
            tpot_percentile_ms=data.get("tpot_percentile_ms"),
        )
    except (KeyError, TypeError) as e:
        raise TraceError(f"tick: {e}") from e


def config_to_json(config: PlannerConfig) -> dict[str, Any]:
    return asdict(config)


def config_with_overrides(base: PlannerConfig, overrides: dict[str, Any]) -> PlannerConfig:
    """`base` with the fields in `overrides` changed (role bounds merged field by field)."""
    merged = config_to_json(base)
    for name, value in overrides.items():
        if name in ("prefill", "decode") and isinstance(value, dict):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return config_from_json(merged)


def config_from_json(data: dict[str, Any]) -> PlannerConfig:
    known = {f.name for f in fields(PlannerConfig)}
    unknown = set(data) - known
    if unknown:
        raise TraceError(f"planner_config: unknown fields {sorted(unknown)}")
    values = dict(data)
    for role in ("prefill", "decode"):
        if role in values:
            values[role] = RoleBounds(**values[role])
    return PlannerConfig(**values)


@dataclass(frozen=True)
class Trace:
    config: PlannerConfig | None
    """The config recorded with the trace, if any."""
    ticks: tuple[TickInput, ...]


def read_trace(path: Path) -> Trace:
    config: PlannerConfig | None = None
    ticks: list[TickInput] = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if "planner_config" in data:
                    config = config_from_json(data["planner_config"])
                else:
                    ticks.append(tick_from_json(data))
            except (ValueError, TypeError) as e:
                raise TraceError(f"{path}:{number}: {e}") from e
    return Trace(config, tuple(ticks))


class TraceWriter:
    """Appends ticks (and once, the config) to a JSONL trace as the live planner runs."""

    def __init__(self, stream: IO[str], config: PlannerConfig) -> None:
        self._stream = stream
        self._stream.write(json.dumps({"planner_config": config_to_json(config)}) + "\n")

    def write(self, tick: TickInput) -> None:
        self._stream.write(json.dumps(tick_to_json(tick)) + "\n")
        self._stream.flush()


def replay(ticks: Iterable[TickInput], config: PlannerConfig) -> Iterator[ScalingDecision]:
    """Run ticks through `plan` in order, threading its memory as the live planner does."""
    memory = PlannerMemory()
    for tick in ticks:
        decision = plan(tick, config, memory)
        memory = decision.memory
        yield decision


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="JSONL trace of TickInputs")
    parser.add_argument(
        "--config", type=Path, help="JSON of PlannerConfig fields to change from the trace's"
    )
    args = parser.parse_args(argv)
    out = out or sys.stdout
    trace = read_trace(args.trace)
    config = trace.config or PlannerConfig()
    if args.config:
        config = config_with_overrides(config, json.loads(args.config.read_text()))
    for decision in replay(trace.ticks, config):
        print(decision.describe(), file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
