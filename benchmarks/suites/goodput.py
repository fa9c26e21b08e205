"""Disaggregated (1 prefill GPU + 1 decode GPU) vs colocated (2 GPUs, each prefill + decode,
chunked prefill) goodput on the same engine, same GPUs, same router and load driver; on one
GPU (`--gpu-fraction 0.5`), the PD pair sharing it vs one colocated worker vs one split worker
(`--modes colocated,pd,split`: prefill and decode loops in their own SM partitions).

For each mode the whole system runs (Ray, Redis, workers, NIXL, router, gRPC); for each
workload a Poisson sweep of request rates goes through the project's headless load driver
(loadtests/load_driver.py, the Locust profile's request generator without gevent). Goodput = the
highest offered rate at which >= 90% of requests meet both the TTFT and the TPOT SLO (the
sweep stops at the first rate that fails). Also measured in the same run: the raw GPU0→GPU1
copy bandwidth, the effective KV transfer GB/s and per-request transfer time vs TTFT.

    python -m benchmarks goodput --model /tmp/llama3-8b --make-model --out OUT

Prints a short table last; writes OUT/results.json, per-run records, and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from admission.config import AdmissionConfig, AdmissionThresholds
from benchmarks.harness.steps import progress as log
from benchmarks.harness.table import Table
from loadtests.goodput import max_rate_meeting, parse_slo, summarize
from loadtests.load_driver import run_planned
from loadtests.records import RequestRecord, write_records
from loadtests.workload import generate, load_profile

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig
    from deploy.control.launch import Cluster

MODES = ("pd", "colocated", "split")
"""`split`: --colocated-workers split workers (one per GPU; engine mode split, adaptive)."""
DEFAULT_RATES = {
    "prefill_heavy": [1.0, 2.0, 3.0, 4.5],
    "balanced": [2.0, 4.0, 6.0, 9.0],
    "decode_heavy": [2.0, 4.0, 8.0, 12.0],
}


THRESHOLDS = AdmissionThresholds(
    max_estimated_ttft_ms=600_000.0,
    max_queue_wait_ms=600_000.0,
    max_inflight_requests=4096,
    max_decode_kv_utilization=1.0,
    local_prefill_threshold_tokens=0,
)
"""The router's admission in every mode: nothing refused for load (a sweep measures the
latencies an overload brings), every prompt of the PD pair handed off."""


def peer_copy_gbps(nbytes: int = 1 << 30) -> float:
    """GB/s of a plain copy from GPU 0 to GPU 1 (0 with fewer than two GPUs)."""
    import torch

    from benchmarks.harness.cuda_timing import copy_seconds

    if torch.cuda.device_count() < 2:
        return 0.0
    gbps = nbytes / copy_seconds(torch.device("cuda:0"), torch.device("cuda:1"), nbytes, 10) / 1e9
    torch.cuda.empty_cache()
    return gbps


def cluster_options(mode: str, model_dir: str, args: argparse.Namespace) -> PdserveConfig:
    from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from engine.config import EngineConfig
    from router.router_server import RouterConfig
    from vocabulary.worker_api import ActorPlacement

    engine = EngineConfig(
        model_dir=model_dir,
        dtype="bfloat16",
        max_num_batched_tokens=(
            args.colocated_budget or args.token_budget if mode == "colocated" else args.token_budget
        ),
        max_num_seqs=256,
        enable_chunked_prefill=True,
        max_model_len=8192,
        num_kv_blocks=args.num_kv_blocks,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
    )
    thresholds = THRESHOLDS
    router = RouterConfig(
        grpc_port=0, metrics_port=None, admission=AdmissionConfig(thresholds=thresholds)
    )
    if mode not in MODES:
        raise ValueError(f"--modes: each of {', '.join(MODES)}, got {mode!r}")
    pd, split = mode == "pd", mode == "split"
    placement = (
        ActorPlacement(num_gpus=args.gpu_fraction, num_cpus=1.0)
        if args.gpu_fraction is not None
        else None  # one GPU per worker where there are GPUs, else CPU
    )
    return PdserveConfig(
        model=model_dir,
        cluster=LaunchConfig(object_store_bytes=2 << 30),
        router=router,
        workers=ClusterSpec(
            engine=engine,
            num_prefill=1 if pd else 0,
            num_decode=1 if pd else 0 if split else args.colocated_workers,
            num_split=args.colocated_workers if split else 0,
            colocated=mode == "colocated",
            placement=WorkerPlacement(default=placement),
        ),
    )


def run_load(target: str, workload: str, rate: float, duration_s: float, seed: int,
             timeout_s: float) -> list[RequestRecord]:  # fmt: skip
    planned = generate(load_profile(workload), rate=rate, duration_s=duration_s, seed=seed)
    return asyncio.run(run_planned(target, planned, offered_rate=rate, timeout_s=timeout_s))


def transfer_stats(cluster: Cluster) -> dict[str, float]:
    """Every decode worker's TransferStats, summed field by field (max for the maxima)."""
    import ray

    totals: dict[str, float] = {}
    for info, handle in ray.get(cluster.controller.list_workers.remote()):
        if info.role.value != "decode":
            continue
        for name, value in asdict(ray.get(handle.transfer_stats.remote())).items():
            if name.startswith("max_") or name == "last_gbps":
                totals[name] = max(totals.get(name, 0.0), float(value))
            else:
                totals[name] = totals.get(name, 0.0) + float(value)
    seconds, moved = totals.get("transfer_seconds", 0.0), totals.get("bytes_transferred", 0.0)
    totals["gbps"] = moved / seconds / 1e9 if seconds else 0.0
    # the names the analysis and the docs use
    totals["bytes"], totals["seconds"] = moved, seconds
    totals["transfers"] = totals.get("transfers_done", 0.0)
    return totals


def engine_steps(cluster: Cluster) -> dict[str, tuple[int, float, int]]:
    """Per worker: engine steps so far, the seconds spent in them (EngineDriver) and the
    requests summed over the steps that ran a batch (the engine's StepStats)."""
    import ray

    def read(actor: Any) -> tuple[int, float, int]:
        driver = actor.runtime.driver
        return driver.num_steps, driver.busy_s, driver.load.steps.batch_requests

    return {
        info.worker_id: tuple(ray.get(handle.__ray_call__.remote(read)))
        for info, handle in ray.get(cluster.controller.list_workers.remote())
    }


def step_ms(
    before: dict[str, tuple[int, float, int]], after: dict[str, tuple[int, float, int]]
) -> str:
    """Mean engine step time and mean batch (requests per step) per worker between two
    `engine_steps` readings."""
    parts = []
    for wid, (n1, s1, b1) in sorted(after.items()):
        n0, s0, b0 = before.get(wid, (0, 0.0, 0))
        if n1 > n0:
            steps = n1 - n0
            parts.append(
                f"{wid} {1000 * (s1 - s0) / steps:.2f} ms x {steps}, "
                f"mean batch {(b1 - b0) / steps:.1f}"
            )
    return ", ".join(parts)


def run_mode(mode: str, model_dir: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from deploy.control.launch import Cluster

    result: dict[str, Any] = {"mode": mode, "runs": {}}
    t0 = time.time()
    with Cluster(cluster_options(mode, model_dir, args)) as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        result["startup_s"] = time.time() - t0
        log(f"{mode}: cluster up in {result['startup_s']:.0f}s at {target}; warming up")
        for workload in args.workloads:
            run_load(target, workload, 4.0, 1.0, seed=99, timeout_s=args.timeout)
        for workload in args.workloads:
            for rate in args.rates[workload]:
                t1, steps0 = time.time(), engine_steps(cluster)
                records = run_load(target, workload, rate, args.duration, args.seed, args.timeout)
                steps = step_ms(steps0, engine_steps(cluster))
                result.setdefault("engine_steps", {})[f"{workload}@{rate:g}"] = steps
                path = out / f"records-{mode}-{workload}-{rate:g}.jsonl"
                write_records(path, records)
                rep = summarize(records, args.slo, offered_rate=rate)
                result["runs"].setdefault(workload, []).append(str(path))
                log(
                    f"{mode} {workload} rate {rate:g}: {rep.completed}/{rep.requests} ok, "
                    f"attain {rep.attainment:.0%}, TTFT p90 {rep.ttft.p90:.0f} ms, "
                    f"TPOT p50/p90 {rep.tpot.p50:.1f}/{rep.tpot.p90:.1f} ms "
                    f"({time.time() - t1:.0f}s); engine step: {steps}"
                )
                if rep.attainment < args.stop_below:
                    log(f"{mode} {workload}: attainment under {args.stop_below:.0%}, next workload")
                    break
        if mode == "pd":
            result["transfer"] = t = transfer_stats(cluster)
            n = t["transfers"] or 1.0
            log(
                f"pd: {t['transfers']:.0f} hand-offs, {t['bytes'] / n / 2**20:.2f} MiB and "
                f"{1000 * t['seconds'] / n:.2f} ms each, {t['gbps']:.1f} GB/s while moving"
            )
    return result


def load_runs(paths: list[str]) -> list[list[RequestRecord]]:
    from loadtests.records import read_records

    return [read_records(Path(p)) for p in paths]


def analyse(
    results: list[dict[str, Any]], args: argparse.Namespace, out: Path, peer_gbps: float
) -> dict[str, Any]:
    slos = {"chat": args.slo, "tight": args.tight_slo}
    table: dict[str, Any] = {
        "peer_copy_gbps": peer_gbps,
        "slos": {k: asdict(v) for k, v in slos.items()},
    }
    for res in results:
        mode = res["mode"]
        for workload, paths in res["runs"].items():
            runs = load_runs(paths)
            entry = table.setdefault(workload, {}).setdefault(mode, {})
            for name, slo in slos.items():
                reports = [summarize(r, slo, offered_rate=r[0].offered_rate) for r in runs if r]
                entry[f"goodput_{name}"] = max_rate_meeting(reports, 0.9)
                entry[f"attainment_{name}"] = {
                    f"{rep.offered_rate:g}": round(rep.attainment, 3) for rep in reports
                }
            first = summarize(runs[0], args.slo) if runs else None
            if first is not None:
                entry["ttft_ms_p50_p90_lowest_rate"] = (first.ttft.p50, first.ttft.p90)
                entry["tpot_ms_p50_p90_lowest_rate"] = (first.tpot.p50, first.tpot.p90)
            xfer = [
                r.server_transfer_ms for run in runs for r in run if r.ok and r.server_transfer_ms
            ]
            ttft = [r.ttft_ms for run in runs for r in run if r.ok and r.ttft_ms]
            if xfer and ttft:
                entry["transfer_ms_p50"] = statistics.median(xfer)
                entry["transfer_over_ttft_p50"] = statistics.median(xfer) / statistics.median(ttft)
        if "transfer" in res:
            table["kv_transfer"] = res["transfer"]
        table.setdefault("engine_steps", {})[mode] = res.get("engine_steps", {})
    for workload in args.workloads:
        w = table.get(workload, {})
        for name in slos:
            pd, co, split = (w.get(m, {}).get(f"goodput_{name}") for m in MODES)
            w[f"ratio_{name}"] = (pd / co) if pd and co else None
            w[f"ratio_split_{name}"] = (split / co) if split and co else None
    (out / "results.json").write_text(json.dumps(table, indent=2, default=str))
    plot(results, args, out)
    return table


def results_from_dirs(dirs: list[str]) -> tuple[list[dict[str, Any]], float]:
    """Rebuild run results from earlier output folders (records-MODE-WORKLOAD-RATE.jsonl)."""
    by_mode: dict[str, dict[str, Any]] = {}
    peer = 0.0
    for d in map(Path, dirs):
        saved = (
            json.loads((d / "results.json").read_text()) if (d / "results.json").is_file() else {}
        )
        peer = max(peer, float(saved.get("peer_copy_gbps", 0.0)))
        for path in d.glob("records-*.jsonl"):
            mode, rest = path.stem.removeprefix("records-").split("-", 1)
            workload, rate = rest.rsplit("-", 1)
            res = by_mode.setdefault(mode, {"mode": mode, "runs": {}})
            res["runs"].setdefault(workload, []).append((float(rate), str(path)))
            if "kv_transfer" in saved and mode == "pd":
                res["transfer"] = saved["kv_transfer"]
    for res in by_mode.values():
        res["runs"] = {w: [p for _, p in sorted(v)] for w, v in res["runs"].items()}
    return list(by_mode.values()), peer


def plot_modes(results: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """SLO attainment vs offered rate, PD and colocated on one figure per workload."""
    from matplotlib.figure import Figure

    for workload in args.workloads:
        fig = Figure(figsize=(11, 4.2), layout="constrained")
        axes = fig.subplots(1, 2)
        for ax, (name, slo) in zip(
            axes, (("chat", args.slo), ("tight", args.tight_slo)), strict=True
        ):
            for res in results:
                runs = [r for r in load_runs(res["runs"].get(workload, [])) if r]
                if not runs:
                    continue
                reps = [summarize(r, slo, offered_rate=r[0].offered_rate) for r in runs]
                ax.plot([x.offered_rate for x in reps], [100 * x.attainment for x in reps],
                        marker="o", label=res["mode"])  # fmt: skip
            ax.axhline(90, color="black", linestyle="--", linewidth=1, label="90% target")
            ax.set_title(f"{workload}: {name} SLO ({slo.describe()})")
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel("% of requests meeting TTFT and TPOT SLOs")
            ax.set_ylim(0, 102)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        fig.savefig(out / f"attainment-{workload}.png", dpi=110)


def plot(results: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    from loadtests.plots import plot_goodput_sweep, plot_latency_cdfs

    plot_modes(results, args, out)

    for workload in args.workloads:
        cdf_runs = []
        for res in results:
            runs = load_runs(res["runs"].get(workload, []))
            if not runs:
                continue
            reports = [
                summarize(r, args.tight_slo, offered_rate=r[0].offered_rate) for r in runs if r
            ]
            plot_goodput_sweep(reports, out / f"goodput-{workload}-{res['mode']}.png")
            cdf_runs.append((f"{res['mode']} @ {runs[0][0].offered_rate:g} req/s", runs[0]))
        if cdf_runs:
            plot_latency_cdfs(cdf_runs, args.tight_slo, out / f"cdf-{workload}.png")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/llama3-8b")
    ap.add_argument(
        "--make-model", action="store_true", help="write the llama3-8b preset if missing"
    )
    ap.add_argument("--out", default="bench-results/goodput")
    ap.add_argument("--modes", default="pd,colocated", help="of " + ",".join(MODES))
    ap.add_argument("--workloads", default="prefill_heavy,balanced,decode_heavy")
    ap.add_argument("--rates", default="", help="workload=r1,r2;... (default: built-in sweep)")
    ap.add_argument("--duration", type=float, default=12.0, help="arrival window per rate (s)")
    ap.add_argument("--slo", default="ttft:1000 tpot:25")
    ap.add_argument("--tight-slo", default="ttft:1000 tpot:15")
    ap.add_argument(
        "--stop-below", type=float, default=0.5, help="end a sweep under this attainment"
    )
    ap.add_argument("--token-budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument(
        "--colocated-budget", type=int, default=0,
        help="colocated mode's max_num_batched_tokens, its prefill chunk (0: --token-budget; "
        "issue 42 gives colocated its best chunk, found by `split_goodput`'s sweep)",
    )  # fmt: skip
    ap.add_argument(
        "--colocated-workers",
        type=int,
        default=2,
        help="colocated (or split) workers (one per GPU)",
    )
    ap.add_argument(
        "--gpu-fraction", type=float, default=None,
        help="GPUs per worker actor (0.5: a prefill and a decode worker share one GPU; "
        "default: one GPU each where there are GPUs, else CPU)",
    )  # fmt: skip
    ap.add_argument(
        "--num-kv-blocks", type=int, default=0,
        help="KV blocks per worker (0: sized from memory; workers sharing a GPU size from their "
        "--gpu-fraction of it)",
    )  # fmt: skip
    ap.add_argument("--quantization", default="none", help="engine weights: none | fp8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="KV pool: auto | fp8")
    ap.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--analyse", nargs="+", metavar="DIR", help="only re-analyse earlier outputs")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.workloads = args.workloads.split(",")
    rates = dict(DEFAULT_RATES)
    for part in filter(None, args.rates.split(";")):
        name, _, values = part.partition("=")
        rates[name.strip()] = [float(v) for v in values.split(",")]
    args.rates = rates
    args.slo, args.tight_slo = parse_slo(args.slo), parse_slo(args.tight_slo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.analyse:
        results, peer = results_from_dirs(args.analyse)
        print_table(analyse(results, args, out, peer), args)
        return 0
    if args.make_model and not (Path(args.model) / "config.json").is_file():
        from deploy.checkpoints.make_model import make_model

        t0 = time.time()
        make_model(args.model, preset="llama3-8b", device="cuda")
        log(f"wrote llama3-8b preset to {args.model} in {time.time() - t0:.0f}s")
    peer = peer_copy_gbps()
    log(f"raw GPU0->GPU1 copy: {peer:.0f} GB/s")
    results = []
    for mode in args.modes.split(","):
        try:
            results.append(run_mode(mode, args.model, args, out))
        except Exception:
            log(f"mode {mode} failed:\n{traceback.format_exc()}")
    table = analyse(results, args, out, peer)
    print_table(table, args)
    return 0


def print_table(table: dict[str, Any], args: argparse.Namespace) -> None:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    rows = []
    for workload in args.workloads:
        w = table.get(workload, {})
        for name in ("chat", "tight"):
            pd, co, split = (w.get(m, {}).get(f"goodput_{name}") for m in MODES)
            rows.append((
                workload, name, fmt(pd), fmt(co), fmt(split),
                ratio(w.get(f"ratio_{name}")), ratio(w.get(f"ratio_split_{name}")),
            ))  # fmt: skip
    print("\n=== goodput (req/s at >=90% SLO attainment) ===")
    header = ("workload", "SLO", "PD", "coloc", "split", "PD/coloc", "split/coloc")
    print(Table.of(header, rows, "llrrrrr").plain())
    kv = table.get("kv_transfer", {})
    print(f"KV transfer effective {kv.get('gbps', 0):.0f} GB/s vs raw copy "
          f"{table['peer_copy_gbps']:.0f} GB/s")  # fmt: skip
