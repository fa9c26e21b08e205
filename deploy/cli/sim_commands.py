"""`pdserve profile`, `pdserve simulate` and `pdserve plan`: measure a worker's engine (one
rank, or a TP group of ranks) into a profile file (deploy/cli/profiling.py,
planner/perf_profile.py), run a cluster of such workers in simulated time (simulator/), and
search the configurations that meet SLOs, each role at each TP size profiled
(simulator/plan.py). Bad input (a profile that does not parse or was made for another
model or dtype, profiles of different models, an unknown workload, a bad count or TP size) is
one line on stderr and exit code 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deploy.cli.command_support import console, fail

if TYPE_CHECKING:
    from simulator.plan import Plan, Point
    from simulator.shape import ClusterShape

PLAN_SHARDS = 32
"""`pdserve plan --shards`' default: at most 32 shards a configuration, 4 workers of each role
a shard at least (`simulator/plan.py:MIN_SHARD_WORKERS`): 128P128D at 1,000 req/s as 32 shards
agreed with the whole simulation within 5.1 % on TTFT, TPOT and goodput and simulates an hour
in ~40 CPU s (docs/benchmarks.md, "Simulator", speed at scale)."""


ProfileModel = Annotated[
    str | None, typer.Option(help="Refuse a profile of another model id (folder name).")
]
ProfileDtype = Annotated[str | None, typer.Option(help="Refuse a profile of another dtype.")]
WorkloadSeed = Annotated[int, typer.Option(help="Workload seed.")]
ProfileFile = Annotated[Path, typer.Option(help="Profile file (pdserve profile).")]
WorkloadOption = Annotated[
    str, typer.Option(help="Load-driver workload profile name or YAML file.")
]
SloOption = Annotated[list[str] | None, typer.Option(help="SLOs, e.g. ttft:500 tpot:50.")]
DEFAULT_SLO = ("ttft:1000", "tpot:100")
"""simulate's and plan's SLOs when none is given."""


def profile(
    out: Annotated[Path, typer.Argument(help="Profile file to write (JSON).")],
    model: Annotated[
        Path | None, typer.Option(help="Model folder (default: the tiny model).")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights and KV dtype (CPU: float32).")] = "float32",
    num_kv_blocks: Annotated[
        int, typer.Option(help="KV blocks of the profiled pool (CPU; the decode pool's size).")
    ] = 4096,
    threads: Annotated[int, typer.Option(help="CPU torch threads (a worker's torch_threads).")] = 1,
    handoff_ms: Annotated[
        float, typer.Option(help="Hand-off time to record (not measured: needs two workers).")
    ] = 12.0,
    request_overhead_ms: Annotated[
        float, typer.Option(help="Serving: send → prompt in a worker's queue (router hop).")
    ] = 0.0,
    prefill_factor: Annotated[
        float, typer.Option(help="Serving: a worker's prefill over the profiled step.")
    ] = 1.0,
    decode_step_overhead_ms: Annotated[
        float, typer.Option(help="Serving: added to every decode step (actor, relay).")
    ] = 0.0,
    quick: Annotated[bool, typer.Option(help="A few grid points only.")] = False,
    load_format: Annotated[
        str, typer.Option(help="auto: the checkpoint's weights; dummy: random, config.json only.")
    ] = "auto",
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            help="Tensor-parallel ranks of the profiled worker (CPU: gloo, each rank --threads; "
            "CUDA: rank r on device r).",
        ),
    ] = 1,
) -> None:
    """Time one worker's engine (rank 0 in this process; with --tp N, ranks 1..N-1 in
    processes of their own, stopped when done) through a grid of prefill and decode steps
    and write the profile `pdserve simulate` and `pdserve plan` read. The tiny model on CPU
    takes ~10-15 s. The serving overheads (default: none, the engine alone) are recorded as
    given: see "Simulator" in docs/benchmarks.md for the values fitted on CPU."""
    from deploy.cli.profiling import ProfileGrid, measure
    from engine.config import LOAD_FORMATS
    from planner.perf_profile import PerfProfileError, ServingOverhead

    if num_kv_blocks < 64:
        fail(f"--num-kv-blocks: must be >= 64, got {num_kv_blocks}", 2)
    if threads < 1:
        fail(f"--threads: must be >= 1, got {threads}", 2)
    if handoff_ms < 0:
        fail(f"--handoff-ms: must be >= 0, got {handoff_ms}", 2)
    if load_format not in LOAD_FORMATS:
        fail(f"--load-format: one of {', '.join(LOAD_FORMATS)}, got {load_format!r}", 2)
    if tp < 1:
        fail(f"--tp: tensor-parallel ranks, must be >= 1, got {tp}", 2)
    try:
        given = (request_overhead_ms / 1000, prefill_factor, decode_step_overhead_ms / 1000)
        serving = ServingOverhead(*given, source="pdserve profile options")
    except PerfProfileError as e:
        fail(str(e), 2)
    if model is None:
        from deploy.checkpoints.make_model import cached_tiny_model

        model = cached_tiny_model()
    elif not (model / "config.json").is_file():
        fail(f"--model: {model} has no config.json", 2)
    if tp > 1:
        _check_tp(model, tp, device)
    grid = ProfileGrid.quick() if quick else ProfileGrid.gpu() if device != "cpu" else ProfileGrid()
    result = measure(
        model, grid, device=device, dtype=dtype, num_kv_blocks=num_kv_blocks,
        torch_threads=threads, handoff_ms=handoff_ms, load_format=load_format,
        tensor_parallel_size=tp, say=console.print,
    )  # fmt: skip
    if given != (0.0, 1.0, 0.0):
        result = replace(result, serving=serving)
    result.save(out)
    h = result.header
    console.print(
        f"wrote {out}: {h.model_id} {h.dtype} TP{h.tensor_parallel_size} on {h.device}, "
        f"{len(result.prefill)} prefill and {len(result.decode)} decode points"
    )
    warn_suspect(result, str(out))


def warn_suspect(perf: object, where: str) -> None:
    """Say which points of a profile cannot be the step they name (planner/profile_checks.py)."""
    from planner.perf_profile import PerfProfile
    from planner.profile_checks import suspect_points

    assert isinstance(perf, PerfProfile)
    for line in suspect_points(perf):
        console.print(f"warning: {where}: suspect point (re-measure it): {line}", style="yellow")


def _check_tp(model: Path, tp: int, device: str) -> None:
    """Refuse (exit 2, nothing started) a TP size that does not split the model (the
    engine's own check) or, on CUDA, one past the visible devices."""
    from engine.tp.tp_shard import check_tp_size
    from vocabulary.model_config import ModelConfig

    try:
        check_tp_size(ModelConfig.from_pretrained(str(model)), tp)
    except ValueError as e:
        fail(f"--tp: {e}", 2)
    if device != "cpu":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if tp > visible:
            fail(f"--tp: {tp} ranks need {tp} CUDA devices (rank r on device r), "
                 f"{visible} visible", 2)  # fmt: skip


def simulate(
    profile: ProfileFile,
    prefill: Annotated[int, typer.Option(help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(help="Decode workers.")] = 1,
    colocated: Annotated[int, typer.Option(help="Colocated workers (prefill + decode).")] = 0,
    split: Annotated[
        int, typer.Option(help="Split workers: prefill and decode loops on one GPU's SMs.")
    ] = 0,
    split_decode_sms: Annotated[
        int, typer.Option(help="Split: the decode partition's SMs, fixed (0: adaptive).")
    ] = 0,
    split_tpot_ms: Annotated[
        float, typer.Option(help="Split, adaptive: the decode step the partition is sized for.")
    ] = 20.0,
    split_total_sms: Annotated[int, typer.Option(help="Split: the GPU's SMs.")] = 132,
    shared_device: Annotated[
        bool,
        typer.Option(
            help="Prefill worker i and decode worker i share one GPU: half the KV pool each, "
            "overlapping steps slowed."
        ),
    ] = False,
    shared_device_slowdown: Annotated[
        float,
        typer.Option(help="--shared-device: a step's time over alone while the other steps."),
    ] = 2.0,
    workload: WorkloadOption = "synthetic",
    rate: Annotated[
        list[float] | None, typer.Option(help="Requests/s (repeatable: a sweep).")
    ] = None,
    duration: Annotated[float, typer.Option(help="Arrival window per rate, seconds.")] = 60.0,
    slo: SloOption = None,
    seed: WorkloadSeed = 0,
    num_requests: Annotated[int | None, typer.Option(help="Cap on requests per rate.")] = None,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks per worker (0: the profile's).")] = 0,
    local_prefill_threshold: Annotated[
        int | None,
        typer.Option(help="Uncached tokens a decode worker prefills itself (default: 64)."),
    ] = None,
    local_prefill_policy: Annotated[
        str,
        typer.Option(
            help="threshold (--local-prefill-threshold) or cost (predicted from the profile)."
        ),
    ] = "threshold",
    stall_weight: Annotated[
        float, typer.Option(help="cost: a stalled stream's wait against the request's own.")
    ] = 1.0,
    chunk: Annotated[
        int, typer.Option(help="Prefill tokens per step of every worker (0: the profile's).")
    ] = 0,
    model: ProfileModel = None,
    dtype: ProfileDtype = None,
    prefill_profile: Annotated[
        Path | None,
        typer.Option(
            help="Prefill workers step on this profile (another TP size of the model); "
            "default: --profile."
        ),
    ] = None,
    shards: Annotated[
        int,
        typer.Option(
            help="Simulate one shard of 1/K of the workers on every K-th request, the report "
            "scaled back: an approximation for large clusters (docs/benchmarks.md, "
            '"Simulator"); K must divide every role\'s workers.'
        ),
    ] = 1,
) -> None:
    """Simulate a cluster of profiled workers under a workload (Poisson or the workload's own
    arrivals, seeded): admission and placement are the router's own; prints the table
    `pdserve bench` prints, from simulated records. Split workers and shared devices: see
    "Simulator" in docs/benchmarks.md for their model and where its defaults come from."""
    from admission.config import AdmissionThresholds, InvalidAdmissionConfig
    from loadtests.bench import print_summary
    from loadtests.goodput import SLOError, parse_slo
    from loadtests.workload import ProfileError
    from planner.perf_profile import PerfProfileError, check_same_worker, load_perf_profile
    from router.prefill_cost import LocalPrefillPolicy
    from simulator.report import as_bench_summary
    from simulator.report import simulate as run_simulation
    from simulator.shape import ClusterShape
    from simulator.split import SplitParams

    rates = rate or [1.0]
    if any(r <= 0 for r in rates):
        fail(f"--rate: must be > 0, got {rates}", 2)
    if duration <= 0:
        fail(f"--duration: must be > 0, got {duration}", 2)
    if kv_blocks < 0:
        fail(f"--kv-blocks: must be >= 0, got {kv_blocks}", 2)
    policies = {p.value: p for p in LocalPrefillPolicy}
    if local_prefill_policy not in policies:
        fail(
            f"--local-prefill-policy: one of {', '.join(policies)}, got {local_prefill_policy!r}", 2
        )
    if not stall_weight >= 0:
        fail(f"--stall-weight: must be >= 0, got {stall_weight}", 2)
    try:
        perf = load_perf_profile(profile, model_id=model, dtype=dtype)
        warn_suspect(perf, str(profile))
        prefill_perf = None
        if prefill_profile is not None:
            prefill_perf = load_perf_profile(prefill_profile, model_id=model, dtype=dtype)
            check_same_worker(perf, prefill_perf)
            warn_suspect(prefill_perf, str(prefill_profile))
        thresholds = AdmissionThresholds()
        if local_prefill_threshold is not None:
            thresholds = AdmissionThresholds(local_prefill_threshold_tokens=local_prefill_threshold)
        params = SplitParams(
            total_sms=split_total_sms, decode_sms=split_decode_sms,
            tpot_target_s=split_tpot_ms / 1000,
        )  # fmt: skip
        tp_sizes = ((prefill_perf or perf).header.tensor_parallel_size,
                    perf.header.tensor_parallel_size)  # fmt: skip
        shape = ClusterShape(
            prefill, decode, colocated, split, kv_blocks, thresholds,
            local_prefill=policies[local_prefill_policy], stall_weight=stall_weight,
            chunk_tokens=chunk, split_params=params, shared_device=shared_device,
            shared_device_slowdown=shared_device_slowdown, prefill_tp=tp_sizes[0],
            decode_tp=tp_sizes[1],
        )  # fmt: skip
        goal = parse_slo(slo or DEFAULT_SLO)
        hint_shards(shape, num_requests or max(rates) * duration, shards)
        results = []
        for r in rates:
            result = run_simulation(
                perf, shape, workload, r, duration, goal, seed, num_requests, prefill_perf,
                keep_records=False, shards=shards,
            )  # fmt: skip
            results.append((r, result))
    except (PerfProfileError, ProfileError, SLOError, InvalidAdmissionConfig, ValueError) as e:
        fail(str(e), 2)
    from simulator.plan import label

    where = "simulated " + label(shape) + (f" as {shards} shards" if shards > 1 else "")
    summary = as_bench_summary(where, str(workload), goal, duration, seed, results)
    print_summary(summary, console)
    console.print(f"local prefill: {local_prefill_policy}")
    for r, result in results:
        use = ", ".join(f"{w.worker_id} {100 * w.busy_fraction:.0f}%" for w in result.workers)
        console.print(f"  {r:g} req/s busy: {use}")
        console.print(f"  {r:g} req/s prefilled: {result.placement_line()}")


def plan(
    profile: Annotated[
        list[Path],
        typer.Option(
            help="Profile file (pdserve profile); repeatable: one per TP size of one model, "
            "dtype and card, each role searched at each."
        ),
    ],
    slo: SloOption = None,
    workload: WorkloadOption = "synthetic",
    rate: Annotated[
        list[float] | None,
        typer.Option(
            help="Requests/s to serve (alone: the fewest GPUs); with --gpus: the "
            "rates to sweep (repeatable)."
        ),
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(help="GPUs to spend: the configuration serving most within SLO.")
    ] = None,
    max_gpus: Annotated[int, typer.Option(help="--rate alone: largest cluster tried.")] = 16,
    chunk: Annotated[
        list[int] | None,
        typer.Option(
            help="Prefill chunks to search, tokens per step (repeatable; default: the "
            "profile's alone)."
        ),
    ] = None,
    split: Annotated[
        bool, typer.Option(help="Also search split workers (zS, their default parameters).")
    ] = False,
    attainment: Annotated[
        float, typer.Option(help="Share of requests that must meet every SLO.")
    ] = 0.9,
    duration: Annotated[float, typer.Option(help="Arrival window per run, seconds.")] = 60.0,
    seed: WorkloadSeed = 0,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write the Pareto plot (tokens/s per GPU vs per user) here (PNG)."),
    ] = None,
    model: ProfileModel = None,
    dtype: ProfileDtype = None,
    shards: Annotated[
        int,
        typer.Option(
            help="At most K shards per configuration: the most that divide its role counts "
            "and keep 4 workers of each role a shard (an approximation for large clusters: "
            'docs/benchmarks.md, "Simulator"); 1: every configuration whole.'
        ),
    ] = PLAN_SHARDS,
) -> None:
    """Search cluster configurations in simulated time (xPyD splits and colocated, split
    workers with --split, each at every --chunk; each role at every TP size a --profile was
    made for, a worker holding one GPU per rank) and print the cheapest that meet the SLOs,
    ranked by goodput per GPU. Exit 1 when none does (the closest is printed, with by how
    much it misses)."""
    import time

    from loadtests.goodput import SLOError, parse_slo
    from loadtests.workload import ProfileError
    from planner.perf_profile import PerfProfileError, load_perf_profile
    from simulator.plan import (
        geometric_rates,
        plan_for_gpus,
        plan_for_rate,
        profiles_by_tp,
        simulator_for,
    )

    if gpus is None and not rate:
        fail("plan: give --rate (the fewest GPUs for it) or --gpus (the most from them)", 2)
    if gpus is None and rate and len(rate) > 1:
        fail("--rate: one rate without --gpus (a sweep needs --gpus)", 2)
    if not 0 < attainment <= 1:
        fail(f"--attainment: must be in (0, 1], got {attainment}", 2)
    if duration <= 0:
        fail(f"--duration: must be > 0, got {duration}", 2)
    if chunk and any(c < 1 for c in chunk):
        fail(f"--chunk: tokens per step, each >= 1, got {chunk}", 2)
    if shards < 1:
        fail(f"--shards: must be >= 1, got {shards}", 2)
    chunks = sorted(set(chunk)) if chunk else [0]
    started = time.perf_counter()
    try:
        loaded = [load_perf_profile(p, model_id=model, dtype=dtype) for p in profile]
        for path, one in zip(profile, loaded, strict=True):
            warn_suspect(one, str(path))
        perfs = profiles_by_tp(loaded)
        tp_sizes = tuple(perfs)
        goal = parse_slo(slo or DEFAULT_SLO)
        run = simulator_for(perfs, workload, duration, goal, seed, shards)
        if gpus is None:
            assert rate
            found = plan_for_rate(
                run,
                rate[0],
                goal,
                max_gpus=max_gpus,
                attainment=attainment,
                chunks=chunks,
                split=split,
                tp_sizes=tp_sizes,
            )
        else:
            rates = rate or geometric_rates(0.5, 32.0, 8)
            found = plan_for_gpus(
                run, gpus, rates, goal, attainment=attainment, chunks=chunks, split=split,
                tp_sizes=tp_sizes,
            )  # fmt: skip
    except (PerfProfileError, ProfileError, SLOError, ValueError) as e:
        fail(str(e), 2)
    _print_plan(found, time.perf_counter() - started)
    if plot is not None:
        _plot_plan(found, plot)
    if not found.chosen:
        raise typer.Exit(1)


def _print_plan(found: Plan, seconds: float) -> None:
    from rich.table import Table

    from simulator.plan import label

    title = f"{found.slo.describe()} for {found.attainment:.0%} of requests (ms, req/s, tokens/s)"
    table = Table(title=title)
    for name in ("config", "GPUs", "req/s", "met", "good/GPU", "tok/s/GPU", "tok/s/user",
                 "TTFT p90", "TPOT p90"):  # fmt: skip
        table.add_column(name, justify="left" if name == "config" else "right")
    shown = found.chosen or found.points
    for p in shown:
        r = p.report
        table.add_row(
            label(p.shape), str(p.gpus), f"{p.rate:g}", f"{r.attainment:.0%}",
            f"{p.goodput_per_gpu:.2f}", f"{p.tokens_per_gpu:.0f}", f"{p.tokens_per_user:.0f}",
            f"{r.ttft.p90:.0f}", f"{r.tpot.p90:.1f}",
        )  # fmt: skip
    console.print(table)
    simulated = sum(p.report.requests for p in found.points)
    console.print(f"{len(found.points)} runs, {simulated} simulated requests in {seconds:.1f} s")
    if found.max_rate:
        rates = ", ".join(
            f"{name} {'-' if r is None else f'{r:g}'}" for name, r in found.max_rate.items()
        )
        console.print(f"highest rate meeting the SLO: {rates}")
    if found.chosen:
        best = found.chosen[0]
        console.print(
            f"cheapest: [bold]{label(best.shape)}[/bold] ({best.gpus} GPU"
            f"{'s' if best.gpus > 1 else ''}) at {best.rate:g} "
            f"req/s, {best.goodput_per_gpu:.2f} good req/s per GPU"
        )
        return
    closest = found.closest
    if closest is None:
        console.print("no configuration was simulated")
        return
    console.print(
        f"[red]no configuration meets {found.slo.describe()}[/red]; closest: "
        f"{label(closest.shape)} at {closest.rate:g} req/s: " + "; ".join(found.misses(closest))
    )


def _plot_plan(found: Plan, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot: needs matplotlib (pip install 'pdserve[bench]')", 2)
    from simulator.plan import label, pareto

    fig, ax = plt.subplots(figsize=(7, 5))
    by_shape: dict[str, list[Point]] = {}
    for p in found.points:
        by_shape.setdefault(label(p.shape), []).append(p)
    for name, points in by_shape.items():
        points = sorted(points, key=lambda p: p.rate)
        ax.plot([p.tokens_per_user for p in points], [p.tokens_per_gpu for p in points],
                marker="o", label=name)  # fmt: skip
    front = pareto(found.points)
    ax.plot([p.tokens_per_user for p in front], [p.tokens_per_gpu for p in front], "k--",
            label="Pareto front")  # fmt: skip
    ax.set_xlabel("tokens/s per user (1000 / TPOT p50)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"simulated, {found.slo.describe()}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    console.print(f"wrote {path}")


COMMANDS = (profile, simulate, plan)
"""This module's commands, in the order `pdserve --help` lists them."""


SHARD_HINT_REQUESTS = 200_000
"""Requests over which `simulate` on a cluster that shards well suggests `--shards`."""


def hint_shards(shape: ClusterShape, requests: float, shards: int) -> None:
    """Say how `--shards` would shorten a long whole simulation of a large cluster."""
    from simulator.plan import MIN_SHARD_WORKERS, label
    from simulator.shards import largest_shards

    if shards > 1 or requests < SHARD_HINT_REQUESTS:
        return
    k = largest_shards(shape, PLAN_SHARDS, MIN_SHARD_WORKERS)
    if k > 1:
        console.print(
            f"[dim]{requests:,.0f} requests over {label(shape)} simulated whole; "
            f"--shards {k} simulates 1/{k} of them, within a few % at scale "
            '(docs/benchmarks.md, "Simulator", speed at scale)[/dim]'
        )
