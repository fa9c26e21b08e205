"""The simulator at scale: how long `pdserve simulate` takes for a large cluster and a high rate
(issue 43's goal: an hour at 1,000 req/s over 256 GPUs in <= 60 s on one core).

A cluster of `--prefill` + `--decode` one-GPU workers on a profile (default the tiny model's
fitted CPU profile, docs/data/tiny-cpu-profile-fitted.json), the `synthetic` workload (Poisson
arrivals) at `--rate` req/s for `--duration` simulated seconds. Prints the wall seconds (and the
process's CPU seconds: on a shared machine the wall clock counts other work too) of the
workload's generation, the simulation and the records' summary together (one loop: the workload
is made as the run pulls it, each request summarized as it ends), the requests simulated per
wall second, the events the simulation processed, the process's max RSS, and the hour
extrapolated from the run's rate (the cost is per request: a longer run is more of the same
steady state).

    taskset -c 0 python -m benchmarks sim_scale [--rate 1000] [--duration 5] \
        [--prefill 128 --decode 128] [--profile PATH] [--slo SLO] [--shards K ...] \
        [--cprofile N]

`--shards K` simulates one shard of 1/K of the cluster on its share of the workload and scales
the report back (simulator/shards.py); several values run each on the same seeded workload and
print each one's TTFT/TPOT p50/p90, goodput and attainment against the first (give 1 first for
the exact simulation). `--cprofile N` runs the simulation under cProfile and prints its N
costliest functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from admission.config import AdmissionThresholds
from loadtests.goodput import SLO, GoodputReport, parse_slo
from loadtests.workload import load_profile, stream
from planner.perf_profile import PerfProfile, load_perf_profile
from simulator.cluster import Simulation
from simulator.report import run_summarized
from simulator.shape import ClusterShape
from simulator.shards import first_shard, scale_report, shard_shape

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "data" / "tiny-cpu-profile-fitted.json"
HOUR_S = 3600.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--workload", default="synthetic")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--duration", type=float, default=5.0, help="simulated seconds")
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-inflight", type=int, default=1 << 20,
                        help="the router's max_inflight_requests (its default 256 caps a "
                        "256-GPU cluster far below 1,000 req/s)")  # fmt: skip
    parser.add_argument("--slo", default="ttft:1000", help="goodput's SLO")
    parser.add_argument("--shards", type=int, nargs="+", default=[1], metavar="K",
                        help="simulate one shard of 1/K of the cluster (simulator/shards.py); "
                        "several: each on the same workload, compared with the first")  # fmt: skip
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    profile = load_perf_profile(args.profile)
    thresholds = AdmissionThresholds(max_inflight_requests=args.max_inflight)
    shape = ClusterShape(args.prefill, args.decode, thresholds=thresholds)
    slo = parse_slo(args.slo)
    print(f"cluster {args.prefill}P{args.decode}D ({args.prefill + args.decode} GPUs), "
          f"{args.workload} at {args.rate:g} req/s for {args.duration:g} simulated s, "
          f"profile {args.profile.name}, SLO {slo.describe()}")  # fmt: skip
    first: GoodputReport | None = None
    for shards in args.shards:
        report = _run(args, profile, shape, slo, shards)
        if first is None:
            first = report
        elif len(args.shards) > 1:
            print(f"  against --shards {args.shards[0]}: " + _diffs(report, first))
    return 0


def _run(
    args: argparse.Namespace, profile: PerfProfile, shape: ClusterShape, slo: SLO, shards: int
) -> GoodputReport:
    # The workload is made as the run pulls it and each request summarized as it ends
    # (simulator/report.py:run_summarized): generation, simulation and records are one loop.
    planned = stream(
        load_profile(args.workload), rate=args.rate, duration_s=args.duration, seed=args.seed,
        shard=first_shard(shards),
    )  # fmt: skip
    sim = Simulation(profile, shard_shape(shape, shards))
    t0, c0 = time.perf_counter(), time.process_time()
    if args.cprofile:
        prof = cProfile.Profile()
        result = prof.runcall(run_summarized, sim, planned, slo, args.rate)
    else:
        result = run_summarized(sim, planned, slo, args.rate)
    run_s, run_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    simulated = result.report.requests
    report = scale_report(result.report, shards)

    per_s = simulated / run_s if run_s > 0 else float("inf")
    hour_s = run_s * HOUR_S / args.duration
    hour_cpu_s = run_cpu_s * HOUR_S / args.duration
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"--shards {shards}: simulated {simulated} requests ({report.completed} completed "
          f"scaled to the cluster), events {sim.events}; TTFT p50 / p90 {report.ttft.p50:.1f} / "
          f"{report.ttft.p90:.1f} ms, TPOT p50 / p90 {report.tpot.p50:.2f} / "
          f"{report.tpot.p90:.2f} ms, goodput {report.goodput_rps:.1f} req/s "
          f"({report.attainment:.1%})")  # fmt: skip
    print(f"  wall: generate + simulate + records + summary {run_s:.2f} s (CPU {run_cpu_s:.2f} s)")
    print(f"  {per_s:,.0f} simulated requests per wall s, {sim.events / run_s:,.0f} events per "
          f"wall s; max RSS of the process so far {rss_mb:.0f} MB")  # fmt: skip
    print(f"  an hour at this rate (extrapolated): {hour_s:,.0f} s wall, {hour_cpu_s:,.0f} s CPU")
    if args.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    return report


def _diffs(report: GoodputReport, base: GoodputReport) -> str:
    def rel(a: float, b: float) -> str:
        return f"{100 * (a / b - 1):+.1f} %" if b else "-"

    new, old = report, base
    parts = [
        f"TTFT p50 {rel(new.ttft.p50, old.ttft.p50)}, p90 {rel(new.ttft.p90, old.ttft.p90)}",
        f"TPOT p50 {rel(new.tpot.p50, old.tpot.p50)}, p90 {rel(new.tpot.p90, old.tpot.p90)}",
        f"goodput {rel(report.goodput_rps, base.goodput_rps)}, attainment "
        f"{100 * (report.attainment - base.attainment):+.1f} points",
    ]
    return "; ".join(parts)
