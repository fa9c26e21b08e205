"""Simulator agreement on CPU: the tiny model profiled on this machine (`pdserve profile`), then a
real 1P1D cluster of it (benchmarks/harness/cluster.py) loaded by the `pdserve bench` driver
(asyncio) at a few rates, and `pdserve simulate` of the same workload, rates and seed on the
profile; the table compares predicted with measured p50/p90 TTFT and TPOT and goodput.

Two predictions per rate: from the engine-only profile, and from the profile with its serving
overheads (`planner/perf_profile.py:ServingOverhead`) measured in the run at the first rate
only (`measure_serving`); the other rates are held out.

    python -m benchmarks simulator --out OUT [--rates 1 2 4] [--duration 30]

Writes OUT/profile.json, OUT/bench/ (the bench output, records per rate) and OUT/agreement.json.
`--records OUT` re-simulates against the records of an earlier run (no cluster started).

Against a `python -m benchmarks goodput` run instead (the GPU's: `gpu_validate.sh trio_*`,
whose profile `gpu_validate.sh profile8b` writes): `--goodput DIR --profile P --mode colocated
--workload W --rates ...` reads DIR/records-MODE-W-RATE.jsonl (every rate ran with the same
`--seed`) and simulates one worker of that mode (colocated: 1C; pd: 1P1D; split: 1S, the
split worker at its default parameters, simulator/split.py) on P, fitting the serving overheads
at the first rate as above; `--chunk` is the run's token budget. `--mode pd --shared-device`
is the run with `--gpu-fraction 0.5`: the pair on one GPU (ClusterShape.shared_device). Where
the simulator scales the prefill step itself (split: its partition; shared device: the other
worker's steps) the prefill factor is not fitted (1): the measured prefill already holds what
the model adds, and fitting it would count that twice.

    python -m benchmarks simulator --goodput trio_ph --profile profile-llama3-8b.json \
        --mode colocated --workload prefill_heavy --rates 4 6 8 10 --duration 8 \
        --slo "ttft:2000 tpot:40" --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from admission.config import AdmissionThresholds
from benchmarks.harness.steps import progress as log
from benchmarks.harness.table import Table
from loadtests.goodput import SLO, GoodputReport, parse_slo, summarize
from loadtests.records import RequestRecord, read_records
from planner.perf_profile import PerfProfile, ServingOverhead, load_perf_profile
from planner.profile_checks import suspect_points
from simulator.report import simulate
from simulator.shape import ClusterShape

KV_BLOCKS = 1024  # benchmarks/harness/cluster.py:tiny_disaggregated's pool


def _pct(pred: float, real: float) -> str:
    if real != real or pred != pred or real == 0:
        return "-"
    return f"{100 * (pred - real) / real:+.0f}%"


def rows(
    rate: float, plain: GoodputReport, pred: GoodputReport, real: GoodputReport
) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, get in (
        ("TTFT p50 ms", lambda r: r.ttft.p50),
        ("TTFT p90 ms", lambda r: r.ttft.p90),
        ("TPOT p50 ms", lambda r: r.tpot.p50),
        ("TPOT p90 ms", lambda r: r.tpot.p90),
        ("goodput req/s", lambda r: r.goodput_rps),
    ):
        a, b, m = get(plain), get(pred), get(real)
        out.append((f"{rate:g}", name, f"{a:.2f}", _pct(a, m), f"{b:.2f}", _pct(b, m), f"{m:.2f}"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sim-agreement"))
    parser.add_argument("--workload", default="synthetic")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--slo", default="ttft:1000 tpot:100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", action="store_true", help="reuse OUT's profile and records")
    parser.add_argument("--goodput", type=Path, default=None, help="a goodput run's output")
    parser.add_argument("--profile", type=Path, default=None, help="with --goodput: its profile")
    parser.add_argument("--mode", choices=("colocated", "pd", "split"), default="pd")
    parser.add_argument(
        "--shared-device", action="store_true",
        help="--mode pd: the pair shared one GPU (the goodput run's --gpu-fraction 0.5)",
    )  # fmt: skip
    parser.add_argument("--chunk", type=int, default=0, help="--goodput: the run's token budget")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    slo = parse_slo(args.slo)
    profile_path = out / "profile.json"
    if args.shared_device and args.mode != "pd":
        raise SystemExit(f"--shared-device: a PD pair on one GPU (--mode pd), not {args.mode}")
    if args.goodput is not None:
        if args.profile is None:
            raise SystemExit("--goodput: give the run's --profile")
        profile_path = args.profile
    elif args.mode == "split" or args.shared_device:
        raise SystemExit("--mode split / --shared-device: against a goodput run (--goodput DIR)")
    elif not args.records:
        from deploy.checkpoints.make_model import cached_tiny_model
        from deploy.cli.profiling import ProfileGrid, measure

        log("profiling the tiny model (1 torch thread, as a worker)")
        t0 = time.perf_counter()
        measure(cached_tiny_model(), ProfileGrid(), say=log).save(profile_path)
        log(f"profile written in {time.perf_counter() - t0:.1f} s")
        _run_cluster(args, out)
    engine_only = load_perf_profile(profile_path)
    for line in suspect_points(engine_only):
        log(f"warning: {profile_path}: suspect point (re-measure it): {line}")
    real = {rate: summarize(read_records(_records_path(args, rate)), slo) for rate in args.rates}
    first = read_records(_records_path(args, args.rates[0]))
    fitted = measure_serving(engine_only, args, args.rates[0], first, slo)
    fitted.save(out / "profile-fitted.json")
    s = fitted.serving
    log(
        f"measured at {args.rates[0]:g} req/s: request hop {s.request_s * 1000:.1f} ms, "
        f"prefill x{s.prefill_factor:.2f}, decode step +{s.decode_step_s * 1000:.2f} ms"
    )
    table: list[tuple[str, ...]] = []
    results = []
    for i, rate in enumerate(args.rates):
        plain = _simulate(engine_only, args, rate, slo, i)
        pred = _simulate(fitted, args, rate, slo, i)
        table += rows(rate, plain, pred, real[rate])
        results.append({
            "rate": rate, "engine_only": _figures(plain), "fitted": _figures(pred),
            "measured": _figures(real[rate]),
        })  # fmt: skip
    (out / "agreement.json").write_text(json.dumps(results, indent=1))
    header = ("req/s", "figure", "engine only", "err", "fitted", "err", "measured")
    print(Table.of(header, table).plain())
    return 0


def measure_serving(
    profile: PerfProfile,
    args: argparse.Namespace,
    rate: float,
    records: Sequence[RequestRecord],
    slo: SLO,
) -> PerfProfile:
    """`profile` with the serving overheads measured in `records` (the run at `rate`):
    the prefill factor is the median of the worker's reported prefill time over the profiled
    step of that prompt; the request hop the median of TTFT minus that prefill time; the
    decode step's cost the measured TPOT p50 minus the one simulated without it. Where the
    simulator scales the prefill step itself (`_scales_prefill`) the factor stays 1."""
    ok = [r for r in records if r.ok and r.server_prefill_ms and r.ttft_ms is not None]
    if not ok:
        raise SystemExit(f"no record at {rate:g} req/s carries server timings")
    factor = 1.0
    if not _scales_prefill(args):
        factor = statistics.median(
            r.server_prefill_ms / (profile.prefill_step_s(r.prompt_tokens) * 1000)  # type: ignore[operator]
            for r in ok
        )
    hop_s = statistics.median(r.ttft_ms - r.server_prefill_ms for r in ok) / 1000  # type: ignore[operator]
    hop_s = max(0.0, hop_s)
    partial = replace(profile, serving=ServingOverhead(hop_s, factor))
    simulated = _simulate(partial, args, rate, slo, 0).tpot.p50
    measured = summarize(records, slo).tpot.p50
    step_s = max(0.0, measured - simulated) / 1000
    source = f"measured at {rate:g} req/s (benchmarks simulator)"
    return replace(profile, serving=ServingOverhead(hop_s, factor, step_s, source))


def _scales_prefill(args: argparse.Namespace) -> bool:
    """The simulated shape scales its prefill steps by a model of its own (split, shared)."""
    return args.goodput is not None and (args.mode == "split" or args.shared_device)


def _records_path(args: argparse.Namespace, rate: float) -> Path:
    """The measured records of the run at `rate`: this suite's bench output, or a goodput
    run's (`--goodput`)."""
    if args.goodput is not None:
        return args.goodput / f"records-{args.mode}-{args.workload}-{rate:g}.jsonl"
    return args.out / "bench" / f"rate-{rate:g}" / "records.jsonl"


def _simulate(
    profile: PerfProfile, args: argparse.Namespace, rate: float, slo: SLO, index: int
) -> GoodputReport:
    """The run at `rate`, the `index`-th of the sweep (its seed: args.seed + index; a goodput
    run's every rate: args.seed)."""
    if args.goodput is None:
        shape = ClusterShape(
            prefill=1,
            decode=1,
            kv_blocks=KV_BLOCKS,
            thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0),
        )
    else:  # the goodput suite's one colocated worker, PD pair or split worker, admitting as it does
        from benchmarks.suites.goodput import THRESHOLDS

        workers = {"colocated": (0, 0, 1, 0), "pd": (1, 1, 0, 0), "split": (0, 0, 0, 1)}
        shape = ClusterShape(
            *workers[args.mode], thresholds=THRESHOLDS, chunk_tokens=args.chunk,
            shared_device=args.shared_device,
        )  # fmt: skip
    seed = args.seed if args.goodput is not None else args.seed + index
    return simulate(profile, shape, args.workload, rate, args.duration, slo, seed).report


def _figures(r: GoodputReport) -> dict[str, float]:
    return {
        "ttft_p50": r.ttft.p50, "ttft_p90": r.ttft.p90, "tpot_p50": r.tpot.p50,
        "tpot_p90": r.tpot.p90, "goodput_rps": r.goodput_rps, "requests": r.requests,
    }  # fmt: skip


def _run_cluster(args: argparse.Namespace, out: Path) -> None:
    """A warm-up run (discarded: the first requests of a fresh cluster pay one-time costs),
    then one run per rate, each with a seed of its own so no rate hits the prefix cache
    another rate filled (the simulator starts each rate empty)."""
    from benchmarks.harness.cluster import local_cluster
    from loadtests.bench import run_bench

    log("starting the 1P1D tiny cluster")
    with local_cluster() as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        run_bench(
            target, args.workload, [2.0], args.slo, 10.0, out / "warmup", use_locust=False,
            seed=args.seed + 1000,
        )  # fmt: skip
        for i, rate in enumerate(args.rates):
            run_bench(
                target, args.workload, [rate], args.slo, args.duration, out / "bench",
                use_locust=False, seed=args.seed + i,
            )  # fmt: skip
