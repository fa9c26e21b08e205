"""`pdserve bench`: run a workload at one or more rates, then write the goodput report.

For each offered rate, the workload runs headless, through Locust in its own process
(`use_locust=True`: Locust's CSV and HTML report too) or through the asyncio driver (no Locust
or gevent needed, as on the GPU machine); both write the same per-request records. Then:

    OUT/rate-R/records.jsonl      one record per request
    OUT/rate-R/locust_*.csv, locust.html, locust.log   (Locust runs only)
    OUT/goodput.csv               one row per rate: goodput, attainment, percentiles
    OUT/summary.json              the same, plus the run's parameters
    OUT/ttft_tpot_cdf.png, OUT/goodput_vs_rate.png
    OUT/summary.txt               the one-screen summary printed at the end

    python -m loadtests.bench --target 127.0.0.1:50051 --profile synthetic --rate 1 2 4 \
        --slo ttft:500 tpot:50 --duration 60 --out bench-results/run1 [--no-locust]
    python -m loadtests.bench --api openai --target http://127.0.0.1:8000 ...

`api` picks the door: "grpc" (target HOST:PORT, the Generate stream) or "openai" (target the
base URL of the OpenAI-compatible HTTP API, streaming /v1/completions; Locust user
loadtests/locust_openai.py, asyncio sender loadtests/openai_driver.py). Both send the same
workload and measure it the same way.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from loadtests.goodput import SLO, GoodputReport, max_rate_meeting, parse_slo, summarize
from loadtests.records import read_records
from loadtests.runspec import RunSpec
from loadtests.workload import load_profile

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
LOCUSTFILE_OPENAI = Path(__file__).with_name("locust_openai.py")
APIS = ("grpc", "openai")


class BenchError(RuntimeError):
    """A load run failed to run (not: requests failed; those are in the report)."""


@dataclass(frozen=True)
class RateResult:
    rate: float
    report: GoodputReport
    run_dir: Path
    records_path: Path
    locust_html: Path | None = None
    locust_csv_prefix: Path | None = None


@dataclass(frozen=True)
class BenchSummary:
    target: str
    profile: str
    api: str
    seed: int
    slo: SLO
    duration_s: float
    used_locust: bool
    results: tuple[RateResult, ...]
    attainment_target: float
    max_rate: float | None
    """Highest offered rate at which >= attainment_target of requests met the SLOs."""
    out_dir: Path
    files: tuple[Path, ...]
    """Everything written (reports, plots, per-rate records and Locust output)."""

    @property
    def reports(self) -> tuple[GoodputReport, ...]:
        return tuple(r.report for r in self.results)


def run_bench(
    target: str,
    profile: str | Path,
    rates: float | Sequence[float],
    slo: SLO | str | Sequence[str],
    duration_s: float,
    out_dir: Path,
    *,
    use_locust: bool = True,
    seed: int = 0,
    num_requests: int | None = None,
    request_timeout_s: float = 300.0,
    attainment_target: float = 0.9,
    itl_events: bool = True,
    console: Console | None = None,
    api: str = "grpc",
) -> BenchSummary:
    """Run `profile` against `target` (host:port, or the HTTP API's base URL with `api`
    "openai") at each rate; write and print the report."""
    if api not in APIS:
        raise ValueError(f"api: one of {', '.join(APIS)}, got {api!r}")
    rate_list = [float(rates)] if isinstance(rates, (int, float)) else [float(r) for r in rates]
    if not rate_list or any(r <= 0 for r in rate_list):
        raise ValueError(f"rate: need one or more rates > 0, got {rate_list}")
    slo = slo if isinstance(slo, SLO) else parse_slo(slo)
    profile_name = load_profile(profile).name  # fails early on a bad profile
    out_dir.mkdir(parents=True, exist_ok=True)
    console = console or Console()
    results = []
    for rate in rate_list:
        run_dir = out_dir / f"rate-{rate:g}"
        run_dir.mkdir(parents=True, exist_ok=True)
        records_path = run_dir / "records.jsonl"
        records_path.unlink(missing_ok=True)
        spec = RunSpec(
            profile=str(profile),
            rate=rate,
            duration_s=duration_s,
            seed=seed,
            num_requests=num_requests,
            records_path=str(records_path),
            request_timeout_s=request_timeout_s,
            itl_events=itl_events,
        )
        console.print(f"[bold]{profile_name}[/bold] at {rate:g} req/s for {duration_s:g} s ...")
        html = csv_prefix = None
        if use_locust:
            html, csv_prefix = _run_locust(target, spec, run_dir, api)
        else:
            from loadtests.load_driver import run_spec

            run_spec(target, spec, api)
        records = read_records(records_path) if records_path.exists() else []
        report = summarize(records, slo, offered_rate=rate)
        results.append(RateResult(rate, report, run_dir, records_path, html, csv_prefix))

    files = [
        *_write_tables(out_dir, results),
        *_write_plots(out_dir, results, slo, attainment_target),
        out_dir / "summary.json",
        out_dir / "summary.txt",
    ]
    for result in results:
        files.append(result.records_path)
        if result.locust_html is not None:
            files.append(result.locust_html)
    summary = BenchSummary(
        target=target,
        profile=profile_name,
        api=api,
        seed=seed,
        slo=slo,
        duration_s=duration_s,
        used_locust=use_locust,
        results=tuple(results),
        attainment_target=attainment_target,
        max_rate=max_rate_meeting([r.report for r in results], attainment_target),
        out_dir=out_dir,
        files=tuple(files),
    )
    (out_dir / "summary.json").write_text(json.dumps(_summary_json(summary), indent=2))
    recorder = Console(record=True, width=120, file=io.StringIO())
    print_summary(summary, recorder)
    (out_dir / "summary.txt").write_text(recorder.export_text())
    print_summary(summary, console)
    return summary


def _run_locust(target: str, spec: RunSpec, run_dir: Path, api: str) -> tuple[Path, Path]:
    if importlib.util.find_spec("locust") is None:
        raise BenchError("locust is not installed: pip install 'pdserve[bench]', or --no-locust")
    html, csv_prefix, log = run_dir / "locust.html", run_dir / "locust", run_dir / "locust.log"
    # A safety limit only: the open-loop user stops the run once its last request is done.
    limit_s = int(spec.duration_s + spec.request_timeout_s + 30)
    locustfile, user = (LOCUSTFILE, "OpenLoopUser")
    if api == "openai":
        locustfile, user = (LOCUSTFILE_OPENAI, "OpenAIOpenLoopUser")
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
        "-u", "1", "-r", "1", "--host", target, "-t", f"{limit_s}s",
        "--csv", str(csv_prefix), "--html", str(html), "--only-summary",
        "--exit-code-on-error", "0", "--stop-timeout", "10", user,
    ]  # fmt: skip
    env = {**os.environ, **spec.to_env()}
    with log.open("w") as out:
        proc = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise BenchError(f"locust exited with {proc.returncode} (see {log}):\n{tail}")
    return html, csv_prefix


_CSV_COLUMNS = (
    "rate", "requests", "completed", "failed", "good", "attainment", "goodput_rps",
    "throughput_rps", "output_tokens_per_s", "duration_s",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
)  # fmt: skip


def _csv_row(rate: float, r: GoodputReport) -> list[object]:
    return [
        rate, r.requests, r.completed, r.failed, r.good, round(r.attainment, 4),
        round(r.goodput_rps, 4), round(r.throughput_rps, 4), round(r.output_tokens_per_s, 2),
        round(r.duration_s, 3),
        *(round(v, 3) for v in (r.ttft.p50, r.ttft.p90, r.ttft.p99, r.tpot.p50, r.tpot.p90,
                                r.tpot.p99, r.itl.p50, r.itl.p99, r.e2e.p50, r.e2e.p99)),
    ]  # fmt: skip


def _write_tables(out_dir: Path, results: Sequence[RateResult]) -> list[Path]:
    path = out_dir / "goodput.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_CSV_COLUMNS)
        for result in results:
            writer.writerow(_csv_row(result.rate, result.report))
    return [path]


def _write_plots(
    out_dir: Path, results: Sequence[RateResult], slo: SLO, attainment_target: float
) -> list[Path]:
    if importlib.util.find_spec("matplotlib") is None:  # e.g. a GPU box without the bench extra
        return []
    from loadtests.plots import plot_goodput_sweep, plot_latency_cdfs

    runs = [(f"{r.rate:g} req/s", read_records(r.records_path)) for r in results]
    cdf = plot_latency_cdfs(runs, slo, out_dir / "ttft_tpot_cdf.png")
    sweep = plot_goodput_sweep(
        [r.report for r in results], out_dir / "goodput_vs_rate.png", attainment_target
    )
    return [cdf, sweep]


def _summary_json(summary: BenchSummary) -> dict[str, object]:
    return {
        "target": summary.target,
        "api": summary.api,
        "profile": summary.profile,
        "seed": summary.seed,
        "slo": asdict(summary.slo),
        "duration_s": summary.duration_s,
        "used_locust": summary.used_locust,
        "attainment_target": summary.attainment_target,
        "max_rate": summary.max_rate,
        "reports": [_nan_to_none(asdict(r.report)) for r in summary.results],
        "files": [str(p) for p in summary.files],
    }


def _nan_to_none(value: object) -> object:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def summary_tables(summary: BenchSummary) -> tuple[Table, Table]:
    """Throughput and latency tables, one row per offered rate (each fits 80 columns)."""
    title = f"pdserve bench: {summary.profile} -> {summary.target}, SLO {summary.slo.describe()}"
    load = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("req/s", "sent", "failed", "met SLO", "goodput req/s", "output tok/s", "run s"):
        load.add_column(name, justify="right", no_wrap=True)
    latency = Table(title="latency, ms", title_justify="left", box=box.SIMPLE_HEAD)
    latency.add_column("req/s", justify="right", no_wrap=True)
    for metric in ("TTFT", "TPOT", "E2E"):
        for q in ("p50", "p90", "p99") if metric != "E2E" else ("p50", "p99"):
            latency.add_column(f"{metric}\n{q}", justify="right", no_wrap=True)
    for result in summary.results:
        r = result.report
        load.add_row(
            f"{result.rate:g}",
            str(r.requests),
            str(r.failed),
            f"{100 * r.attainment:.1f}%",
            f"{r.goodput_rps:.2f}",
            f"{r.output_tokens_per_s:.0f}",
            f"{r.duration_s:.1f}",
        )
        latency.add_row(
            f"{result.rate:g}",
            *(_ms(v) for v in (r.ttft.p50, r.ttft.p90, r.ttft.p99)),
            *(_ms(v) for v in (r.tpot.p50, r.tpot.p90, r.tpot.p99)),
            *(_ms(v) for v in (r.e2e.p50, r.e2e.p99)),
        )
    return load, latency


def print_summary(summary: BenchSummary, console: Console) -> None:
    """The one-screen summary: the table, the max rate under SLO, failures and files."""
    for table in summary_tables(summary):
        console.print(table)
    target = f">= {100 * summary.attainment_target:g}% of requests meeting the SLO"
    if summary.max_rate is None:
        console.print(f"max rate with {target}: [red]none of the rates tried[/red]")
    else:
        console.print(f"max rate with {target}: [bold]{summary.max_rate:g} req/s[/bold]")
    for result in summary.results:
        if result.report.failures:
            failures = ", ".join(f"{status} x{n}" for status, n in result.report.failures)
            console.print(f"  {result.rate:g} req/s failures: {failures}")
    console.print(
        f"driver: {'locust' if summary.used_locust else 'asyncio'}, {summary.api} API; "
        f"output in {summary.out_dir}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark a running pdserve cluster.")
    parser.add_argument(
        "--target", default="127.0.0.1:50051", help="gRPC host:port, or the HTTP API's base URL"
    )
    parser.add_argument("--api", choices=APIS, default="grpc", help="which API to load")
    parser.add_argument("--profile", default="synthetic", help="profile name or YAML path")
    parser.add_argument("--rate", type=float, nargs="+", required=True, help="req/s (a sweep)")
    parser.add_argument("--slo", nargs="+", required=True, help="ttft:MS tpot:MS [e2el:MS]")
    parser.add_argument("--duration", type=float, default=60.0, help="arrival window per rate, s")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, s")
    parser.add_argument("--attainment", type=float, default=0.9, help="target fraction meeting SLO")
    parser.add_argument("--no-locust", action="store_true", help="use the asyncio driver")
    args = parser.parse_args(argv)
    run_bench(
        args.target,
        args.profile,
        args.rate,
        args.slo,
        args.duration,
        args.out,
        use_locust=not args.no_locust,
        seed=args.seed,
        num_requests=args.num_requests,
        request_timeout_s=args.timeout,
        attainment_target=args.attainment,
        api=args.api,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
