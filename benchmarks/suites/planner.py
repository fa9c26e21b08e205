"""The reactive planner against the predictive one on one recorded ramp-and-burst trace, in the
simulator (issue 43: the predictive planner has at most half the SLO-violating requests of the
reactive rules at no more worker-seconds).

The trace is the `ramp_burst` workload (loadtests/profiles/ramp_burst.yaml: 0.2x `--rate` for
60 s, a ramp to 1x by 180 s, a 30 s burst at 1.6x, back to 0.2x by 330 s; `synthetic`'s
lengths), generated once from `--seed` and written to OUT/trace.jsonl. Each planner replays
it through the simulator (simulator/autoscale.py: the controller's own `PlannerLoop` ticking
every `--interval` simulated seconds) from the same `--prefill`P`--decode`D cluster, a worker
serving `--startup` seconds after it is asked for; the predictive planner sizes each role from
`--profile`, the profile the simulated workers step on. A request violates the SLO when it is
refused or misses TTFT or TPOT; a worker's seconds run from its request to its stop.

    python -m benchmarks planner [--rate 100] [--seed 0] [--slo "ttft:200 tpot:20"]
        [--startup 30] [--interval 5] [--max-workers 16] [--out OUT] [--timeline]

Writes OUT/trace.jsonl (the requests: send time, prompt and output tokens) and OUT/planner.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from admission.config import AdmissionThresholds
from benchmarks.harness.table import Table
from loadtests.goodput import SLO, parse_slo, summarize
from loadtests.workload import PlannedRequest, generate, load_profile
from planner.core import PlannerConfig, RoleBounds
from planner.loop import PlannerSettings
from planner.perf_profile import PerfProfile, load_perf_profile
from planner.predictive import PlannerMode, PredictiveConfig
from simulator.autoscale import ScalingRun, replay
from simulator.report import to_record
from simulator.shape import ClusterShape
from simulator.workers import Role

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "data" / "tiny-cpu-profile-fitted.json"
WORKLOAD = "ramp_burst"


@dataclass(frozen=True)
class Outcome:
    """One planner's replay, summed up."""

    mode: PlannerMode
    requests: int
    violating: int
    """Refused, or over the TTFT or TPOT SLO."""
    worker_seconds: float
    prefill_worker_seconds: float
    decode_worker_seconds: float
    peak: tuple[int, int]
    """Most (prefill, decode) workers asked for at once."""
    run: ScalingRun


def settings(
    mode: PlannerMode, slo: SLO, max_workers: int, startup_s: float, interval_s: float
) -> PlannerSettings:
    """The planner of `mode` as `pdserve up --planner` runs it, with the trace's SLOs and
    bounds (1..`max_workers` per role) and, predictive, `startup_s` of lead."""
    config = PlannerConfig(
        ttft_slo_ms=slo.ttft_ms or PlannerConfig.ttft_slo_ms,
        tpot_slo_ms=slo.tpot_ms or PlannerConfig.tpot_slo_ms,
        prefill=RoleBounds(1, max_workers),
        decode=RoleBounds(1, max_workers),
    )
    return PlannerSettings(
        enabled=True, interval_s=interval_s, config=config, mode=mode.value,
        predictive=PredictiveConfig(startup_s=startup_s),
    )  # fmt: skip


def compare(
    profile: PerfProfile,
    planned: Sequence[PlannedRequest],
    slo: SLO,
    shape: ClusterShape,
    max_workers: int = 16,
    startup_s: float = 30.0,
    interval_s: float = 5.0,
) -> dict[PlannerMode, Outcome]:
    """Both planners over the same requests from the same starting cluster."""
    out = {}
    for mode in PlannerMode:
        run = replay(profile, shape, planned, settings(mode, slo, max_workers, startup_s,
                     interval_s), startup_s)  # fmt: skip
        records = [to_record(r, None) for r in run.requests]
        out[mode] = Outcome(
            mode, len(records), sum(not slo.met_by(r) for r in records), run.worker_seconds(),
            run.worker_seconds(Role.PREFILL), run.worker_seconds(Role.DECODE), _peak(run), run,
        )  # fmt: skip
    return out


def trace(rate: float, seed: int) -> list[PlannedRequest]:
    return generate(load_profile(WORKLOAD), rate=rate, seed=seed)


def starting_shape(prefill: int, decode: int) -> ClusterShape:
    """The cluster both planners start from, the router's in-flight limit lifted (the planner,
    not admission's default cap, is what is compared)."""
    return ClusterShape(
        prefill, decode, thresholds=AdmissionThresholds(max_inflight_requests=1 << 20)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--rate", type=float, default=100.0, help="the trace's 1x, req/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", default="ttft:200 tpot:20")
    parser.add_argument("--startup", type=float, default=30.0, help="worker start-up, s")
    parser.add_argument("--interval", type=float, default=5.0, help="planner tick, s")
    parser.add_argument("--max-workers", type=int, default=16, help="per role")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers at the start")
    parser.add_argument("--decode", type=int, default=1, help="decode workers at the start")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeline", action="store_true", help="print the workers per 20 s")
    args = parser.parse_args(argv)
    profile = load_perf_profile(args.profile)
    slo = parse_slo(args.slo.split())
    planned = trace(args.rate, args.seed)
    got = compare(profile, planned, slo, starting_shape(args.prefill, args.decode),
                  args.max_workers, args.startup, args.interval)  # fmt: skip
    print(f"{WORKLOAD} at {args.rate:g} req/s (seed {args.seed}, {len(planned)} requests), "
          f"SLO {slo.describe()}, start-up {args.startup:g} s, tick {args.interval:g} s, "
          f"{args.prefill}P{args.decode}D at the start, profile {args.profile.name}")  # fmt: skip
    header = ("planner", "violating", "of which refused", "TTFT p90 ms", "TPOT p90 ms",
              "worker-s (P + D)", "peak P/D")  # fmt: skip
    rows = []
    for o in got.values():
        records = [to_record(r, None) for r in o.run.requests]
        report = summarize(records, slo)
        refused = sum(not r.ok for r in records)
        rows.append((
            o.mode.value, f"{o.violating} ({100 * o.violating / o.requests:.1f}%)", str(refused),
            f"{report.ttft.p90:.0f}", f"{report.tpot.p90:.1f}",
            f"{o.worker_seconds:.0f} ({o.prefill_worker_seconds:.0f} + "
            f"{o.decode_worker_seconds:.0f})", f"{o.peak[0]}/{o.peak[1]}",
        ))  # fmt: skip
    print(Table.of(header, rows).plain())
    reactive, predictive = got[PlannerMode.REACTIVE], got[PlannerMode.PREDICTIVE]
    violating = _ratio(predictive.violating, reactive.violating)
    worker_s = _ratio(predictive.worker_seconds, reactive.worker_seconds)
    print(f"predictive / reactive: violating {violating}, worker-seconds {worker_s}")
    if args.timeline:
        for o in got.values():
            print(f"{o.mode.value}: " + "; ".join(
                f"{t}s {p}P{d}D" for t, p, d in _timeline(o.run, 20.0)))  # fmt: skip
    if args.out is not None:
        _write(args, planned, got)
    return 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _asked(run: ScalingRun, role: Role, t: float) -> int:
    """Workers of `role` asked for and not draining at `t`."""
    return sum(1 for s in run.spans if s.role is role and s.requested_s <= t
               and (s.draining_s is None or t < s.draining_s))  # fmt: skip


def _peak(run: ScalingRun) -> tuple[int, int]:
    times = sorted({s.requested_s for s in run.spans})
    return (max(_asked(run, Role.PREFILL, t) for t in times),
            max(_asked(run, Role.DECODE, t) for t in times))  # fmt: skip


def _timeline(run: ScalingRun, every_s: float) -> list[tuple[int, int, int]]:
    steps = int(run.end_s // every_s) + 1
    return [(int(i * every_s), _asked(run, Role.PREFILL, i * every_s),
             _asked(run, Role.DECODE, i * every_s)) for i in range(steps)]  # fmt: skip


def _write(args: argparse.Namespace, planned: Sequence[PlannedRequest],
           got: dict[PlannerMode, Outcome]) -> None:  # fmt: skip
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with (out / "trace.jsonl").open("w") as f:
        for p in planned:
            f.write(json.dumps({"send_at_s": p.send_at_s, "prompt_tokens": p.prompt_tokens,
                                "max_tokens": p.max_tokens}) + "\n")  # fmt: skip
    result: dict[str, Any] = {"workload": WORKLOAD, "rate": args.rate, "seed": args.seed,
                              "slo": args.slo, "startup_s": args.startup,
                              "interval_s": args.interval}  # fmt: skip
    for mode, o in got.items():
        result[mode.value] = {
            "requests": o.requests, "violating": o.violating, "worker_seconds": o.worker_seconds,
            "prefill_worker_seconds": o.prefill_worker_seconds,
            "decode_worker_seconds": o.decode_worker_seconds, "peak": list(o.peak),
            "decisions": list(o.run.decisions),
        }  # fmt: skip
    (out / "planner.json").write_text(json.dumps(result, indent=1) + "\n")
