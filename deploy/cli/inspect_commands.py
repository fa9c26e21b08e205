"""`pdserve generate` and `pdserve status` (registered on the app in deploy/cli/app.py): one
request, streamed, with the timings its last message carries (one line; every stage with
`-v`), and the cluster's status, once or live (`--watch`: the table refreshes in place every
`--interval` seconds until Ctrl-C, or `--count` refreshes; a pipe gets each refresh in turn).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from deploy.cli.command_support import checked_options, console, router_for
from deploy.cli.options import check_count, check_seconds

if TYPE_CHECKING:
    from deploy.cli import cluster_client as client
    from pdserve.v1 import serving_pb2 as pb


def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = all tokens.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate past end-of-sequence.")] = False,
    lora: Annotated[
        str, typer.Option(help="LoRA adapter to generate with (`pdserve lora list`).")
    ] = "",
    target: Annotated[
        str | None, typer.Option(help="HOST:PORT (default: running cluster).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Request deadline in seconds.")] = 120.0,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Also print the request's timings stage by stage, as the "
            "router and the workers measured them, with its usage and workers.",
        ),
    ] = False,
) -> None:  # fmt: skip
    """Send one request through the gRPC API and stream the answer, then TTFT/TPOT."""
    from deploy.cli import cluster_client as client
    from pdserve.v1 import serving_pb2 as pb

    with checked_options():  # the server checks meaning; these would not fit the message
        check_count(max_tokens, "--max-tokens")
        check_count(top_k, "--top-k")
        if seed is not None:
            check_count(seed, "--seed")
        check_seconds(timeout, "--timeout", allow_zero=False)
    request = pb.GenerateRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stop or [],
        ignore_eos=ignore_eos,
        lora=lora,
    )
    if seed is not None:
        request.seed = seed
    with router_for(target) as addr:
        console.print(f"[dim]{escape(prompt)}[/dim]", end="")
        try:
            result = client.generate(addr, request, console, timeout)
        finally:
            console.print()  # ends the prompt + answer line, also when the stream failed
    console.print(f"[cyan]{client.timings_line(result)}[/cyan]")
    if verbose:
        console.print(timings_table(result))


def timings_table(result: client.GenerationResult) -> Table:
    """Every timing, count and worker the request's last message carries (`Timings`,
    `Usage`), beside what this client measured."""
    t, u = result.last.timings, result.last.usage
    table = Table(title=f"request {result.last.request_id}", box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("stage")
    table.add_column("ms", justify="right")
    table.add_column("measured by")
    rows = [
        ("admission queue", t.queue_ms, "router"),
        ("prefill", t.prefill_ms, t.decode_worker if t.local_prefill else t.prefill_worker),
        ("KV transfer", t.transfer_ms, t.decode_worker),
        ("TTFT", t.ttft_ms, "router"),
        ("TPOT (mean)", t.tpot_ms, "router"),
        ("end to end", t.e2e_ms, "router"),
        ("TTFT", result.client_ttft_ms, "this client"),
        ("TPOT (mean)", result.client_tpot_ms, "this client"),
    ]
    for stage, ms, who in rows:
        table.add_row(stage, f"{ms:.2f}", who or "(not shown)")
    table.caption = (
        f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached, "
        f"{u.transferred_prompt_tokens} transferred) · {u.completion_tokens} generated · "
        f"finish {result.finish_reason} · "
        + ("local prefill" if t.local_prefill else "disaggregated")
    )
    return table


def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    events: Annotated[
        int, typer.Option(help="Recent controller events / planner decisions to show.")
    ] = 5,
    target: Annotated[
        str | None, typer.Option(help="HOST:PORT (default: running cluster).")
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh the table in place until Ctrl-C.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between --watch refreshes.")] = 2.0,
    count: Annotated[
        int, typer.Option(help="With --watch: stop after this many refreshes (0: never).")
    ] = 0,
) -> None:
    """Per worker: role, state, node, device, KV blocks, requests in flight, queue, transfers,
    TTFT/TPOT; then the router's APIs (gRPC, OpenAI HTTP), the request limits, the
    controller's recent events and the planner's last decision (from the control log)."""
    from deploy.cli import cluster_client as client

    with checked_options():
        check_seconds(interval, "--interval", allow_zero=False)
        check_count(count, "--count")
        if watch and as_json:
            raise typer.BadParameter("--watch: a live table, not with --json")
    with router_for(target, admin=True) as addr:
        st = client.status(addr)
    log = client.control_log_summary(_control_log_path(target), events)
    if as_json:
        print(client.status_json(st, log))
        return
    if watch:
        _watch(addr, target, events, interval, count, status_view(st, addr, log))
        return
    # A pipe gets the whole table, not one squeezed into 80 columns.
    out = console if console.is_terminal else Console(width=200)
    out.print(status_view(st, addr, log))


def status_view(
    st: pb.ClusterStatus, addr: client.Target, log: client.ControlLogSummary
) -> RenderableType:
    """The status screen: the workers' table, then one line each for the APIs, the limits,
    the recent events and the planner's last decision."""
    from deploy.cli import cluster_client as client

    lines: list[RenderableType] = [client.status_table(st)]
    if st.http_url:
        grpc = st.grpc_target or addr  # (a router older than the field: the admin address)
        lines.append(Text(f"  api:      gRPC {grpc} · OpenAI {st.http_url}/v1"))
    lines += [Text(f"  {line}") for line in client.split_lines(st)]
    lines += [Text(f"  {line}") for line in (*client.limits_lines(st), *log.events)]
    if log.planner:
        lines.append(Text(f"  {log.planner}", style="cyan"))
    return Group(*lines)


def _watch(
    addr: client.Target,
    target: str | None,
    events: int,
    interval: float,
    count: int,
    first: RenderableType,
) -> None:
    """Refresh the status every `interval` s: in place on a terminal (rich.live), one after
    another on a pipe. A router that stops answering shows as a line until it answers again.
    Ctrl-C ends it, exit 0."""
    import grpc
    from rich.live import Live

    from deploy.cli import cluster_client as client
    from deploy.cli import daemon

    def frame(view: RenderableType | None = None) -> RenderableType:
        if view is None:
            try:
                st = client.status(addr)
                view = status_view(
                    st, addr, client.control_log_summary(_control_log_path(target), events)
                )
            except grpc.RpcError as e:
                view = Text(f"  router {addr}: {client.rpc_error_line(e)}", style="red")
        stamp = time.strftime("%H:%M:%S")
        head = Text(f"pdserve status · every {interval:g} s · {stamp} · Ctrl-C stops", "dim")
        return Group(head, view)

    # Ctrl-C sets a flag the loop reads between refreshes: a KeyboardInterrupt raised inside a
    # gRPC call or channel teardown could leave the process hung instead of exiting
    with daemon.SignalFlag(signal.SIGINT) as stop:
        shown = 1
        if console.is_terminal:
            with Live(frame(first), console=console, auto_refresh=False) as live:
                while (not count or shown < count) and not stop.wait(interval):
                    live.update(frame(), refresh=True)
                    shown += 1
        else:
            out = Console(width=200)
            out.print(frame(first))
            while (not count or shown < count) and not stop.wait(interval):
                out.print(frame())
                shown += 1
    if stop.is_set:
        console.print()


def _control_log_path(target: str | None) -> str:
    """The running cluster's control log, when `target` is that cluster (or not given)."""
    from deploy.cli import daemon

    state = daemon.read_state()
    if state is None or (target and target not in state.targets):
        return ""
    return state.control_log
