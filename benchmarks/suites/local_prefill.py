"""Local prefill by predicted cost vs the fixed threshold, on a real 1P1D cluster of the tiny
model (CPU) and in the simulator, on the same seeded workload.

The tiny model is profiled here (`pdserve profile`, one torch thread), with the serving
overheads given (default: those "Simulator" in docs/benchmarks.md measured on this machine,
run B). One cluster (benchmarks/harness/cluster.py, 1024 KV blocks per worker) serves two
routers side by side: its own, under the `threshold` policy (admission's default, 64 uncached
tokens), and one started here under `cost` with that profile. After a short warm-up through
each, in each round both arms run the same seeded workload, one after the other (which goes
first alternates round by round; the machine's load drifts over minutes, hence short rounds
and figures paired round by round), each run with its token ids shifted by a run-specific
offset (a bijection on the workload's vocabulary: the same lengths, arrivals and prefix
sharing, but no run hits the prefix cache another run filled). Each run's placements are read
off its router's metrics. Then the simulator runs the same workload, rate and seed on the same
profile under both policies.

    python -m benchmarks local_prefill --out OUT [--workload mixed] [--rate 6] [--duration 15]
        [--rounds 6] [--slo "ttft:200 tpot:20"]

Writes OUT/profile.json, OUT/<policy>/round-<k>.jsonl and OUT/local_prefill.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness.steps import progress as log
from benchmarks.harness.table import Table
from loadtests.goodput import SLO, GoodputReport, parse_slo, summarize
from loadtests.load_driver import run_planned
from loadtests.records import RecordSink, RequestRecord
from loadtests.workload import PlannedRequest, generate, load_profile
from planner.perf_profile import PerfProfile, ServingOverhead, load_perf_profile
from router.prefill_cost import LocalPrefillPolicy
from simulator.report import simulate
from simulator.shape import ClusterShape

KV_BLOCKS = 1024
ARMS = tuple(p.value for p in LocalPrefillPolicy)  # threshold, cost
PLACEMENTS = "pdserve_prefill_placements_total"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("local-prefill"))
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--slo", default="ttft:200 tpot:20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-overhead-ms", type=float, default=9.9)
    parser.add_argument("--prefill-factor", type=float, default=1.41)
    parser.add_argument("--decode-step-overhead-ms", type=float, default=1.61)
    parser.add_argument("--profile", type=Path, help="use this profile instead of measuring")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    slo = parse_slo(args.slo.split())
    profile = _profile(args, out)
    planned = generate(
        load_profile(args.workload), rate=args.rate, duration_s=args.duration, seed=args.seed
    )
    measured = _run_cluster(args, out, planned)
    result: dict[str, Any] = {"workload": args.workload, "rate": args.rate,
                              "duration_s": args.duration, "rounds": args.rounds,
                              "slo": args.slo, "seed": args.seed}  # fmt: skip
    rows = []
    for arm in ARMS:
        runs, placed = measured[arm]
        real = summarize([r for run in runs for r in run], slo, offered_rate=args.rate)
        goodput = statistics.mean(summarize(run, slo).goodput_rps for run in runs)
        shape = ClusterShape(1, 1, kv_blocks=KV_BLOCKS, local_prefill=LocalPrefillPolicy(arm))
        sim = simulate(profile, shape, args.workload, args.rate, args.duration, slo, args.seed)
        result[arm] = {
            "measured": {**_figures(real, goodput), "placements": placed},
            "simulated": {
                **_figures(sim.report, sim.report.goodput_rps),
                "placements": sim.placement_line(),
            },
        }
        rows.append((arm, "measured", *_cells(real, goodput), _placed(placed)))
        rows.append(
            (arm, "simulated", *_cells(sim.report, sim.report.goodput_rps), sim.placement_line())
        )
    result["rounds_measured"] = paired = _paired(measured, slo)
    (out / "local_prefill.json").write_text(json.dumps(result, indent=1))
    header = ("policy", "run", "requests", "met SLO", "goodput req/s", "TTFT p50/p90 ms",
              "TPOT p50/p90 ms", "prefilled")  # fmt: skip
    print(Table.of(header, rows).plain())
    by_round = ("round", "first", "met SLO thr / cost", "goodput thr / cost",
                "TTFT p90 thr / cost", "TPOT p90 thr / cost")  # fmt: skip
    print(Table.of(by_round, [_round_cells(r) for r in paired]).plain())
    diff = {k: statistics.median(r["cost"][k] - r["threshold"][k] for r in paired)
            for k in ("attainment", "goodput_rps", "ttft_p90", "tpot_p90")}  # fmt: skip
    print("paired, cost - threshold, median over rounds: " + ", ".join(
        f"{k} {v:+.3f}" for k, v in diff.items()))  # fmt: skip
    return 0


def _paired(measured: Measured, slo: SLO) -> list[dict[str, Any]]:
    """Each round's figures of both arms (which ran first alternates: round 0 threshold)."""
    out = []
    for k, runs in enumerate(zip(*(measured[a][0] for a in ARMS), strict=True)):
        reports = [summarize(run, slo) for run in runs]
        figures = {a: _figures(r, r.goodput_rps) for a, r in zip(ARMS, reports, strict=True)}
        out.append({"round": k, "first": ARMS[k % 2], **figures})
    return out


def _round_cells(r: dict[str, Any]) -> tuple[str, ...]:
    t, c = r["threshold"], r["cost"]
    return (
        str(r["round"]), r["first"], f"{100 * t['attainment']:.1f}% / {100 * c['attainment']:.1f}%",
        f"{t['goodput_rps']:.2f} / {c['goodput_rps']:.2f}",
        f"{t['ttft_p90']:.1f} / {c['ttft_p90']:.1f}", f"{t['tpot_p90']:.2f} / {c['tpot_p90']:.2f}",
    )  # fmt: skip


def _profile(args: argparse.Namespace, out: Path) -> PerfProfile:
    """The tiny model's profile with the serving overheads given (saved to OUT/profile.json)."""
    path = out / "profile.json"
    if args.profile is not None:
        profile = load_perf_profile(args.profile)
    else:
        from deploy.checkpoints.make_model import cached_tiny_model
        from deploy.cli.profiling import ProfileGrid, measure

        log("profiling the tiny model (1 torch thread, as a worker)")
        profile = measure(cached_tiny_model(), ProfileGrid(), num_kv_blocks=KV_BLOCKS, say=log)
        serving = ServingOverhead(
            args.request_overhead_ms / 1000, args.prefill_factor,
            args.decode_step_overhead_ms / 1000, "benchmarks local_prefill options",
        )  # fmt: skip
        profile = replace(profile, serving=serving)
    profile.save(path)
    return profile


def shifted(planned: Sequence[PlannedRequest], offset: int, low: int, high: int) -> list[Any]:
    """`planned` with every token id moved by `offset` within [low, high) (the same shift for
    every request: prefixes the workload shares stay shared)."""
    span = high - low
    return [
        replace(p, token_ids=tuple(low + (t - low + offset) % span for t in p.token_ids))
        for p in planned
    ]


Measured = dict[str, tuple[list[list[RequestRecord]], dict[str, float]]]
"""Per arm: each run's records, and its placements over every run (site/reason -> count)."""


def _run_cluster(args: argparse.Namespace, out: Path, planned: list[PlannedRequest]) -> Measured:
    """A warm-up run through each router (discarded: a fresh cluster's first requests pay
    one-time costs), then both arms round by round on one cluster."""
    from admission.config import AdmissionConfig
    from benchmarks.harness.cluster import local_cluster, tiny_disaggregated

    config = tiny_disaggregated(num_kv_blocks=KV_BLOCKS)
    router = replace(
        config.router, metrics_port=0, admission=AdmissionConfig()
    )  # admission's default thresholds: the threshold arm is `pdserve up`'s default
    config = replace(config, router=router)
    workload = load_profile(args.workload)
    got: Measured = {a: ([], {}) for a in ARMS}

    def one_run(arm: str, offset: int, path: Path, until_s: float | None = None) -> None:
        target, metrics = targets[arm]
        run = shifted(planned, offset * 97, workload.vocab_low, workload.vocab_high)
        run = [p for p in run if until_s is None or p.send_at_s < until_s]
        before = _placements(metrics)
        path.parent.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)
        log(f"{path.stem}: {arm} ({len(run)} requests at {args.rate:g} req/s)")
        sink = RecordSink(path)
        try:
            records = asyncio.run(run_planned(target, run, offered_rate=args.rate, sink=sink))
        finally:
            sink.close()
        time.sleep(2.0)  # the last streams' blocks return before the next run
        if until_s is not None:
            return
        after = _placements(metrics)
        got[arm][0].append(records)
        for key, n in after.items():
            got[arm][1][key] = got[arm][1].get(key, 0.0) + n - before.get(key, 0.0)

    log("starting the 1P1D tiny cluster and a second router (policy cost)")
    with local_cluster(config) as cluster:
        assert cluster.endpoint is not None
        targets = {"threshold": (cluster.endpoint.target, cluster.endpoint.metrics[0])}
        targets["cost"] = _cost_router(cluster, out / "profile.json")
        for i, arm in enumerate(ARMS):
            one_run(arm, 2 * args.rounds + 1 + i, out / arm / "warmup.jsonl", until_s=5.0)
        for k in range(args.rounds):
            order = ARMS if k % 2 == 0 else ARMS[::-1]
            for i, arm in enumerate(order):  # no two runs share a token sequence
                one_run(arm, 1 + 2 * k + i, out / arm / f"round-{k}.jsonl")
    return got


def _cost_router(cluster: Any, profile: Path) -> tuple[str, str]:
    """A second router on the cluster's workers, under the cost policy with `profile`: its
    gRPC target and metrics URL."""
    import ray

    from deploy.control.cluster_controller import CONTROLLER_NAME
    from router.router_server import RouterActor

    endpoint = cluster.endpoint
    cfg = cluster.config
    orchestrator = cfg.router.orchestrator
    local = replace(orchestrator.local_prefill, policy="cost", profile=str(profile))
    cfg = replace(
        cfg, router=replace(cfg.router, orchestrator=replace(orchestrator, local_prefill=local))
    )
    cost = cfg.prefill_cost_model(endpoint.model_dir)
    router_config = cfg.replica_config(
        1, endpoint.model_dir, endpoint.redis_url, block_hash=endpoint.block_hash,
        prefill_cost=cost,
    )  # fmt: skip
    actor: Any = ray.remote(RouterActor).options(name="local-prefill-cost-router", num_cpus=0)
    handle = actor.remote(router_config, CONTROLLER_NAME, cfg.cluster.name)
    cluster.routers.append(handle)  # stopped with the cluster
    ports: Any = ray.get(handle.start.remote())
    return f"127.0.0.1:{ports.grpc}", f"http://127.0.0.1:{ports.metrics}/metrics"


def _placements(url: str) -> dict[str, float]:
    """`site/reason` -> count from a router's metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == PLACEMENTS:
                found[f"{s.labels['site']}/{s.labels['reason']}"] = s.value
    return found


def _placed(placed: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(placed.items()) if v)


def _figures(r: GoodputReport, goodput_rps: float) -> dict[str, float]:
    """Percentiles over every run's requests; goodput per run (its mean, for the cluster)."""
    return {
        "requests": r.requests, "attainment": r.attainment, "goodput_rps": goodput_rps,
        "ttft_p50": r.ttft.p50, "ttft_p90": r.ttft.p90,
        "tpot_p50": r.tpot.p50, "tpot_p90": r.tpot.p90,
    }  # fmt: skip


def _cells(r: GoodputReport, goodput_rps: float) -> tuple[str, ...]:
    return (
        str(r.requests), f"{100 * r.attainment:.1f}%", f"{goodput_rps:.2f}",
        f"{r.ttft.p50:.1f} / {r.ttft.p90:.1f}", f"{r.tpot.p50:.2f} / {r.tpot.p90:.2f}",
    )  # fmt: skip
