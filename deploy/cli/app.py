"""The `pdserve` command line: make-model, up, config show, down, status, generate,
rebalance, switch, drain, undrain (deploy/cli/worker_commands.py), thresholds, bench, profile,
simulate, plan (deploy/cli/sim_commands.py).

Exit codes: 0 done; 1 the cluster said no, or there is none to ask (one line on stderr: no
cluster running, no router answering, or the server's status code and message); 2 a bad
option, refused before anything starts or any RPC is sent (one line naming the option).

Commands that talk to a cluster find it through the state file `up` writes: the data plane
(generate, bench) at its gRPC target, the admin plane (status, drain, undrain, rebalance,
switch, thresholds) at its own port; `--target` overrides (a running cluster's data target
stands for its admin plane there). With API keys on, the admin key is `$PDSERVE_ADMIN_KEY` or
the state file's, and `generate` sends `$PDSERVE_API_KEY` or the admin key; with TLS, the
router's certificate is verified with `$PDSERVE_TLS_CA` or the state file's, and
`$PDSERVE_TLS_CLIENT_CERT` / `$PDSERVE_TLS_CLIENT_KEY` are presented for mutual TLS.

`generate` and `status` (with `-v` and `--watch`) live in deploy/cli/inspect_commands.py; what every
command module shares (consoles, the one-line failure, the router to call) in
deploy/cli/command_support.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from deploy.cli import inspect_commands as cli_inspect
from deploy.cli import lora_commands as cli_lora
from deploy.cli import sim_commands as cli_sim
from deploy.cli import worker_commands as cli_workers
from deploy.cli.command_support import checked_options, console, fail, router_for
from deploy.cli.options import (
    ConfigArgs,
    check_count,
    check_loras,
    check_model_dir,
    check_model_fit,
    check_seconds,
    config_options,
    effective_config,
    read_config,
)

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig
    from engine.loading.fp8_checkpoint import Fp8Scheme
    from engine.loading.int_checkpoint import IntScheme

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode LLM serving on Ray, NIXL and Redis.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """pdserve: disaggregated prefill/decode LLM serving on Ray, NIXL and Redis."""


@app.command("make-model")
def make_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint into.")],
    preset: Annotated[
        str, typer.Option(help="tiny (trained, CPU), llama3-8b or llama3-70b (random).")
    ] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed: same seed, same bytes.")] = 0,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    layers: Annotated[int | None, typer.Option(help="Number of decoder layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size.")] = None,
    intermediate: Annotated[int | None, typer.Option(help="MLP intermediate size.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Key/value heads (GQA).")] = None,
    vocab: Annotated[int | None, typer.Option(help="Model vocabulary size.")] = None,
    train_steps: Annotated[int | None, typer.Option(help="Training steps on the corpus.")] = None,
    device: Annotated[str, typer.Option(help="Where random weights are drawn.")] = "cpu",
    quantization: Annotated[
        str,
        typer.Option(
            help="none; fp8: compressed-tensors FP8; int8: W8A8 (int-quantized); int4: W4A16 "
            "(pack-quantized): llm-compressor's formats; gptq: the int4 weights in the GPTQ "
            "format (AutoGPTQ / GPTQModel, symmetric, no act-order)."
        ),
    ] = "none",
    group_size: Annotated[int, typer.Option(help="int4: input columns per weight scale.")] = 128,
    weight_scales: Annotated[
        str, typer.Option(help="fp8 weight scales: channel (one per output row) or tensor.")
    ] = "channel",
    activations: Annotated[
        str,
        typer.Option(
            help="fp8 activations: dynamic (per token), static (scales from the "
            "corpus) or none (weights only)."
        ),
    ] = "dynamic",
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="int4 / gptq: round by GPTQ against each projection's inputs on the bundled "
            "corpus (default: to nearest).",
        ),
    ] = False,
    config_only: Annotated[
        bool, typer.Option("--config-only", help="Only config.json and tokenizer (no weights).")
    ] = False,
    source: Annotated[
        Path | None,
        typer.Option("--from", help="Quantize this dense checkpoint folder (any --quantization)."),
    ] = None,
) -> None:
    """Write a Llama-architecture checkpoint in Hugging Face format (no download)."""
    from deploy.checkpoints.fp8_writer import quantize_checkpoint
    from deploy.checkpoints.int_writer import quantize_int_checkpoint
    from deploy.checkpoints.make_model import make_model

    with checked_options():
        int_scheme = _int_scheme(quantization, group_size)
        fp8 = None if int_scheme else _fp8_scheme(quantization, weight_scales, activations)
        if source is not None and ((fp8 is None and int_scheme is None) or config_only):
            raise typer.BadParameter("--from: only with a --quantization (and weights)")
        if calibrate and (int_scheme is None or int_scheme.bits != 4):
            raise typer.BadParameter("--calibrate: only with --quantization int4 or gptq")
    if source is not None:
        try:
            if fp8 is not None:
                path = quantize_checkpoint(source, out_dir, fp8)
            else:
                assert int_scheme is not None
                path = quantize_int_checkpoint(source, out_dir, int_scheme, calibrate)
        except (ValueError, FileNotFoundError) as e:
            fail(f"--from {source}: {e}", 2)
        rounded = ", GPTQ-rounded on the corpus" if calibrate else ""
        console.print(f"wrote {fp8 or int_scheme}{rounded} checkpoint of {source} to "
                      f"[bold]{path}[/bold]")  # fmt: skip
        return

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "torch_dtype": dtype,
            "num_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "vocab_size": vocab,
            "train_steps": train_steps,
        }.items()
        if v is not None
    }
    try:
        path = make_model(
            out_dir, preset=preset, seed=seed, device=device, fp8=fp8, int_scheme=int_scheme,
            calibrate=calibrate, config_only=config_only, **overrides,
        )  # fmt: skip
    except ValueError as e:
        fail(str(e), 2)
    what = "config and tokenizer" if config_only else "checkpoint"
    scheme = fp8 or int_scheme
    label = f" ({scheme}{', GPTQ-rounded on the corpus' if calibrate else ''})" if scheme else ""
    console.print(f"wrote {preset} {what}{label} to [bold]{path}[/bold]")


def _int_scheme(quantization: str, group_size: int) -> IntScheme | None:
    """make-model's INT options as a scheme (None: not an INT quantization)."""
    from engine.loading.int_checkpoint import IntScheme

    if quantization not in ("int8", "int4", "gptq"):
        return None
    if quantization == "int8":
        return IntScheme(8)
    if group_size <= 0:
        raise typer.BadParameter(f"--group-size: a positive number, got {group_size}")
    return IntScheme(4, group_size, source="gptq" if quantization == "gptq" else "")


def _fp8_scheme(quantization: str, weight_scales: str, activations: str) -> Fp8Scheme | None:
    """make-model's FP8 options as a scheme (None: dense); typer.BadParameter naming the
    option that does not fit."""
    from engine.loading.fp8_checkpoint import WEIGHT_STRATEGIES, Fp8Scheme

    if quantization not in ("none", "fp8"):
        raise typer.BadParameter(
            f"--quantization: none, fp8, int8, int4 or gptq, got {quantization!r}"
        )
    if weight_scales not in WEIGHT_STRATEGIES:
        raise typer.BadParameter(f"--weight-scales: channel or tensor, got {weight_scales!r}")
    if activations not in ("dynamic", "static", "none"):
        raise typer.BadParameter(f"--activations: dynamic, static or none, got {activations!r}")
    if quantization == "none":
        return None
    if activations == "none":
        return Fp8Scheme(weight_scales, dynamic_activations=True, activation_strategy="none")
    return Fp8Scheme(weight_scales, dynamic_activations=activations == "dynamic")


# ---- cluster ------------------------------------------------------------------------------


@app.command()
@config_options
def up(
    config: ConfigArgs,
    detach: Annotated[bool, typer.Option(help="Return once the API answers.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for --detach.")] = 900.0,
    log_file: Annotated[Path | None, typer.Option(hidden=True)] = None,
) -> None:
    """Start a cluster: Redis, Ray, prefill + decode workers, router; print the endpoint."""
    from deploy.cli import daemon

    running = daemon.read_state()
    if running is not None:
        fail(f"a cluster is already running (pid {running.pid}, {running.target})", 1)
    with checked_options():  # every value, flags and file alike, before anything starts
        check_seconds(timeout, "--timeout", allow_zero=False)
        given = read_config(config)
        if given.get("cluster.address") is None:
            from deploy.control.local_ray import loopback_env

            loopback_env()  # before the first `import ray` (Ray reads it on import)
        tree = effective_config(given)
        dummy = tree.workers.engine.load_format == "dummy"  # weights made on the device
        check_model_dir(tree.model, given.where("model"), weights=not dummy)
        check_model_fit(tree, given)
        engine = tree.workers.engine
        check_loras(
            engine.loras, tree.model, engine.max_lora_rank, given.where("workers.engine.loras")
        )
        _check_access(tree)
    if detach:
        log_path = daemon.state_path().parent / "pdserve-up.log"
        console.print(f"starting pdserve in the background (log: {log_path}) ...")
        try:
            state = daemon.spawn_detached(config.argv(), log_path, timeout)
        except (RuntimeError, TimeoutError) as e:
            fail(str(e), 1)
        _print_endpoint(state)
        return
    _run_foreground(tree, log_file)


config_app = typer.Typer(help="The config tree that `up` runs with.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(cli_lora.app, name="lora")


@config_app.command("show")
@config_options
def config_show(config: ConfigArgs) -> None:
    """Print the effective config tree (defaults, then --config, then flags) as the YAML that
    `--config` reads."""
    from deploy.control.config_tree import config_yaml

    with checked_options():
        tree = effective_config(read_config(config))
    print(config_yaml(tree), end="")


def _check_access(tree: PdserveConfig) -> None:
    """The API keys load, and nothing listens beyond loopback without them (unless
    --insecure): typer.BadParameter naming the option otherwise."""
    from deploy.control.security import SecurityError, cluster_access, exposure_refusal

    try:
        refusal = exposure_refusal(tree, cluster_access(tree))
    except SecurityError as e:
        raise typer.BadParameter(str(e)) from None
    if refusal is not None:
        raise typer.BadParameter(refusal)


def _run_foreground(config: PdserveConfig, log_file: Path | None) -> None:
    from deploy.cli import daemon
    from deploy.control.launch import Cluster

    cluster = Cluster(config)
    console.print("starting pdserve (Redis, Ray, workers, router) ...")
    try:
        endpoint = cluster.start()  # (it stops what it started when it fails)
    except Exception as e:
        fail(f"cluster failed to start: {e}", 1)
    state, follower = None, None
    try:  # from here on, whatever fails, the cluster stops with this process
        control_log = daemon.new_control_log()  # exists (empty) once the state file names it
        state = daemon.foreground_state(cluster, endpoint, log_file, control_log)
        daemon.write_state(state)
        _print_endpoint(state)
        console.print("serving; Ctrl-C or `pdserve down` stops it")
        follower = daemon.ControlLogFollower(cluster, control_log)
        daemon.wait_for_signal(on_idle=follower.poll)
    finally:
        console.print("stopping ...")
        if follower is not None:
            follower.poll()
        cluster.stop()
        if state is not None:
            daemon.clear_state(state.pid)
        console.print("stopped")


def _http_urls(state: Any) -> list[str]:
    """Each router's OpenAI HTTP API, as it reports it (none where it serves none)."""
    import grpc

    from deploy.cli import cluster_client as client

    try:
        targets = [client.resolve(t, admin=True) for t in state.targets]
        return [url for t in targets if (url := client.status(t, timeout_s=5).http_url)]
    except (grpc.RpcError, client.NoRouter, OSError):
        return []


def _print_endpoint(state: Any) -> None:
    from deploy.control.embedded_redis import redact_url

    console.print(f"[bold green]pdserve is up[/bold green]: gRPC {', '.join(state.targets)}")
    urls = _http_urls(state)
    if urls:
        console.print(f"  openai   {', '.join(u + '/v1' for u in urls)}")
    if state.admin_targets:
        auth = "admin key in the state file" if state.admin_key else "no API keys"
        console.print(f"  admin    {', '.join(state.admin_targets)} ({auth})")
    if state.metrics:
        console.print(f"  metrics  {', '.join(state.metrics)}")
    console.print(f"  redis    {redact_url(state.redis_url)}")
    console.print(f"  model    {state.model_dir}")
    if state.ray_address:
        console.print(f"  ray      {state.ray_address}")
    if state.control_log:
        console.print(f"  events   {state.control_log}")


@app.command()
def down(
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a clean stop.")] = 120.0,
    address: Annotated[
        str | None,
        typer.Option(
            help="Also remove pdserve actors left on this Ray cluster by an `up` that died "
            "(the detached controller, its workers, routers)."
        ),
    ] = None,
    cluster_name: Annotated[
        str, typer.Option(help="With --address: the name of the cluster to remove.")
    ] = "pdserve",
) -> None:
    """Stop the cluster that `pdserve up` started."""
    from deploy.cli import daemon

    with checked_options():
        check_seconds(timeout, "--timeout", allow_zero=True)
    state = daemon.stop_cluster(timeout)
    if state is None:
        console.print("no pdserve cluster is running")
    else:
        console.print(f"stopped pdserve (pid {state.pid})")
    if address:
        from deploy.control.launch import remove_leftovers

        killed = remove_leftovers(address, cluster_name)
        console.print(f"removed from {address}: {', '.join(killed) or 'nothing left'}")


for _command in (
    cli_inspect.generate,
    cli_inspect.status,
    *cli_sim.COMMANDS,
    *cli_workers.COMMANDS,
):
    app.command()(_command)


@app.command()
def thresholds(
    max_estimated_ttft_ms: Annotated[
        float | None, typer.Option(help="Reject when the estimated TTFT passes this (ms).")
    ] = None,
    max_queue_wait_ms: Annotated[
        float | None, typer.Option(help="Longest admission-queue wait (ms); 0 disables it.")
    ] = None,
    max_inflight_requests: Annotated[
        int | None, typer.Option(help="Requests admitted and not finished, per router.")
    ] = None,
    max_decode_kv_utilization: Annotated[
        float | None, typer.Option(help="Fraction of decode KV admission may reserve.")
    ] = None,
    local_prefill_threshold_tokens: Annotated[
        int | None, typer.Option(help="Uncached prompt tokens prefilled on the decode worker.")
    ] = None,
    target: Annotated[
        str | None, typer.Option(help="HOST:PORT (default: running cluster).")
    ] = None,
) -> None:
    """Show the router's admission thresholds, or change the ones given (at run time)."""
    from deploy.cli import cluster_client as client

    with checked_options():  # the server checks ranges; a negative count does not fit the message
        if max_inflight_requests is not None:
            check_count(max_inflight_requests, "--max-inflight-requests")
        if local_prefill_threshold_tokens is not None:
            check_count(local_prefill_threshold_tokens, "--local-prefill-threshold-tokens")
    changes = {
        k: v
        for k, v in {
            "max_estimated_ttft_ms": max_estimated_ttft_ms,
            "max_queue_wait_ms": max_queue_wait_ms,
            "max_inflight_requests": max_inflight_requests,
            "max_decode_kv_utilization": max_decode_kv_utilization,
            "local_prefill_threshold_tokens": local_prefill_threshold_tokens,
        }.items()
        if v is not None
    }
    with router_for(target, admin=True) as addr:
        current = client.thresholds(addr, changes)
    for field, value in current.items():
        console.print(f"{field:32} {value:g}")


@app.command()
def bench(
    profile: Annotated[str, typer.Option(help="Workload profile name or YAML file.")] = "synthetic",
    rate: Annotated[
        list[float] | None, typer.Option(help="Requests/s (repeatable: a sweep).")
    ] = None,
    slo: Annotated[list[str] | None, typer.Option(help="SLOs, e.g. ttft:500 tpot:50.")] = None,
    duration: Annotated[float, typer.Option(help="Seconds per rate.")] = 30.0,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("bench-results"),
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    num_requests: Annotated[int | None, typer.Option(help="Cap on requests per rate.")] = None,
    no_locust: Annotated[bool, typer.Option(help="Use the asyncio driver, not Locust.")] = False,
    attainment: Annotated[float, typer.Option(help="Goodput attainment target.")] = 0.9,
    api: Annotated[
        str, typer.Option(help="grpc (Generate) or openai (the router's HTTP /v1/completions).")
    ] = "grpc",
    target: Annotated[
        str | None, typer.Option(help="HOST:PORT (default: running cluster).")
    ] = None,
    admin_target: Annotated[
        str | None,
        typer.Option(
            help="The router's admin plane, where --api openai finds the HTTP API "
            "(default: the running cluster's for --target)."
        ),
    ] = None,
) -> None:
    """Run a Locust load test headless and write CSV, HTML, plots and a goodput summary."""
    from deploy.cli import cluster_client as client
    from loadtests.bench import APIS, BenchError, run_bench
    from loadtests.goodput import SLOError
    from loadtests.workload import ProfileError

    if api not in APIS:
        fail(f"--api: one of {', '.join(APIS)}, got {api!r}", 2)
    with router_for(target) as addr:
        client.require_router(addr)
    with router_for(admin_target or target, admin=True) as admin_addr:
        # the OpenAI API's address comes from the router itself (its http_port)
        url = client.status(admin_addr).http_url if api == "openai" else addr.address
    if not url:
        fail(f"--api openai: the router at {addr} serves no HTTP API (http_port: null)", 1)
    try:
        run_bench(
            url,
            profile,
            rate or [1.0],
            " ".join(slo or ["ttft:1000", "tpot:100"]),
            duration,
            out,
            use_locust=not no_locust,
            seed=seed,
            num_requests=num_requests,
            attainment_target=attainment,
            console=console,
            api=api,
        )
    except (ValueError, SLOError, ProfileError) as e:
        fail(str(e), 2)
    except BenchError as e:
        fail(f"bench failed: {e}", 1)


@app.command()
@config_options
def chaos(
    config: ConfigArgs,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 600.0,
    load: Annotated[float, typer.Option(help="Offered load as a multiple of capacity.")] = 2.0,
    kill_every: Annotated[
        float, typer.Option(help="Seconds between worker kills (0: none).")
    ] = 30.0,
    redis_restart_every: Annotated[
        float, typer.Option(help="Seconds between Redis restarts (0: none).")
    ] = 120.0,
    cancel_share: Annotated[float, typer.Option(help="Share of requests cancelled.")] = 0.1,
    deadline_share: Annotated[
        float, typer.Option(help="Share of requests given a short deadline.")
    ] = 0.05,
    max_tokens: Annotated[int, typer.Option(help="Tokens per request.")] = 48,
    seed: Annotated[int, typer.Option(help="Seed of prompts, arrivals and faults.")] = 0,
    out: Annotated[Path, typer.Option(help="Folder for chaos.json.")] = Path("chaos-results"),
) -> None:
    """Start a local cluster (the `up` flags), serve open-loop load on it while killing
    workers, restarting Redis and cancelling requests; report what was lost, wrong, hung or
    leaked (exit code 1 unless nothing was)."""
    from deploy.cli.chaos_command import run_chaos
    from loadtests.chaos_run import ChaosConfig

    if daemon_running():
        fail("a cluster is already running: chaos starts its own (`pdserve down` first)", 1)
    with checked_options():
        try:
            spec = ChaosConfig(
                duration_s=duration, load_multiple=load, kill_every_s=kill_every,
                redis_restart_every_s=redis_restart_every, cancel_share=cancel_share,
                deadline_share=deadline_share, max_tokens=max_tokens, seed=seed,
            )  # fmt: skip
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        given = read_config(config)
        if given.get("cluster.address") is None:
            from deploy.control.local_ray import loopback_env

            loopback_env()
        tree = effective_config(given)
        check_model_dir(tree.model, given.where("model"), weights=True)
    report = run_chaos(tree, spec, out, console)
    if not report.clean:
        fail(f"the chaos run found faults (see {out / 'chaos.json'})", 1)


def daemon_running() -> bool:
    from deploy.cli import daemon

    return daemon.read_state() is not None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
