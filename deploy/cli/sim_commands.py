"""`pdserve profile` and `pdserve simulate`: measure a worker's engine into a profile file
(deploy/cli/profiling.py, planner/perf_profile.py), and run a cluster of such workers in
simulated time (simulator/). Bad input (a profile that does not parse or was made for another
model or dtype, an unknown workload, a bad count) is one line on stderr and exit code 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from deploy.cli.command_support import console, fail


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
) -> None:
    """Time one worker's engine (in this process) through a grid of prefill and decode steps
    and write the profile `pdserve simulate` reads. The tiny model on CPU takes ~10-15 s.
    The serving overheads (default: none, the engine alone) are recorded as given: see
    "Simulator" in docs/benchmarks.md for the values fitted on CPU."""
    from deploy.cli.profiling import ProfileGrid, measure
    from planner.perf_profile import PerfProfileError, ServingOverhead

    if num_kv_blocks < 64:
        fail(f"--num-kv-blocks: must be >= 64, got {num_kv_blocks}", 2)
    if threads < 1:
        fail(f"--threads: must be >= 1, got {threads}", 2)
    if handoff_ms < 0:
        fail(f"--handoff-ms: must be >= 0, got {handoff_ms}", 2)
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
    grid = ProfileGrid.quick() if quick else ProfileGrid()
    result = measure(
        model, grid, device=device, dtype=dtype, num_kv_blocks=num_kv_blocks,
        torch_threads=threads, handoff_ms=handoff_ms, say=console.print,
    )  # fmt: skip
    if given != (0.0, 1.0, 0.0):
        result = replace(result, serving=serving)
    result.save(out)
    h = result.header
    console.print(
        f"wrote {out}: {h.model_id} {h.dtype} TP{h.tensor_parallel_size} on {h.device}, "
        f"{len(result.prefill)} prefill and {len(result.decode)} decode points"
    )


def simulate(
    profile: Annotated[Path, typer.Option(help="Profile file (pdserve profile).")],
    prefill: Annotated[int, typer.Option(help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(help="Decode workers.")] = 1,
    colocated: Annotated[int, typer.Option(help="Colocated workers (prefill + decode).")] = 0,
    workload: Annotated[
        str, typer.Option(help="Load-driver workload profile name or YAML file.")
    ] = "synthetic",
    rate: Annotated[
        list[float] | None, typer.Option(help="Requests/s (repeatable: a sweep).")
    ] = None,
    duration: Annotated[float, typer.Option(help="Arrival window per rate, seconds.")] = 60.0,
    slo: Annotated[list[str] | None, typer.Option(help="SLOs, e.g. ttft:500 tpot:50.")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    num_requests: Annotated[int | None, typer.Option(help="Cap on requests per rate.")] = None,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks per worker (0: the profile's).")] = 0,
    local_prefill_threshold: Annotated[
        int | None,
        typer.Option(help="Uncached tokens a decode worker prefills itself (default: 64)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Refuse a profile of another model id (folder name).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="Refuse a profile of another dtype.")] = None,
) -> None:
    """Simulate a cluster of profiled workers under a workload (Poisson or the workload's own
    arrivals, seeded): admission and placement are the router's own; prints the table
    `pdserve bench` prints, from simulated records."""
    from admission.config import AdmissionThresholds, InvalidAdmissionConfig
    from loadtests.bench import print_summary
    from loadtests.goodput import SLOError, parse_slo
    from loadtests.workload import ProfileError
    from planner.perf_profile import PerfProfileError, load_perf_profile
    from simulator.cluster import ClusterShape
    from simulator.report import as_bench_summary
    from simulator.report import simulate as run_simulation

    rates = rate or [1.0]
    if any(r <= 0 for r in rates):
        fail(f"--rate: must be > 0, got {rates}", 2)
    if duration <= 0:
        fail(f"--duration: must be > 0, got {duration}", 2)
    if kv_blocks < 0:
        fail(f"--kv-blocks: must be >= 0, got {kv_blocks}", 2)
    try:
        perf = load_perf_profile(profile, model_id=model, dtype=dtype)
        thresholds = AdmissionThresholds()
        if local_prefill_threshold is not None:
            thresholds = AdmissionThresholds(local_prefill_threshold_tokens=local_prefill_threshold)
        shape = ClusterShape(prefill, decode, colocated, kv_blocks, thresholds)
        goal = parse_slo(" ".join(slo or ["ttft:1000", "tpot:100"]))
        results = [
            (r, run_simulation(perf, shape, workload, r, duration, goal, seed, num_requests))
            for r in rates
        ]
    except (PerfProfileError, ProfileError, SLOError, InvalidAdmissionConfig, ValueError) as e:
        fail(str(e), 2)
    where = f"simulated {prefill}P{decode}D" + (f"+{colocated}C" if colocated else "")
    summary = as_bench_summary(where, str(workload), goal, duration, seed, results)
    print_summary(summary, console)
    for r, result in results:
        use = ", ".join(f"{w.worker_id} {100 * w.busy_fraction:.0f}%" for w in result.workers)
        console.print(f"  {r:g} req/s busy: {use}")
