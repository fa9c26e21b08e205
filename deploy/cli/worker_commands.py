"""`pdserve rebalance`, `switch`, `drain`, `undrain`: moving workers between roles and out of
service on a running cluster, through the router's admin plane (router/servicer.py → the
controller: deploy/control/rebalance.py, deploy/control/role_switch.py).

Each exits 0 when done, 1 when the cluster said no (one line: the status code and what is
wrong; nothing changed) or when the workers' requests outlasted the timeout (the worker is
back in service as it was), 2 for a bad option (refused before any RPC).
"""

from __future__ import annotations

from typing import Annotated

import typer

from deploy.cli.command_support import checked_options, console, router_for
from deploy.cli.options import check_count, check_seconds

Target = Annotated[str | None, typer.Option(help="HOST:PORT (default: running cluster).")]
DrainTimeout = Annotated[
    float | None,
    typer.Option(help="Seconds its requests may take to finish (>= 0) [server: 120]."),
]


def rebalance(
    prefill: Annotated[int, typer.Option(help="Prefill workers wanted.")],
    decode: Annotated[int, typer.Option(help="Decode workers wanted.")],
    timeout: Annotated[float, typer.Option(help="Seconds to drain each worker.")] = 300.0,
    restart: Annotated[
        bool,
        typer.Option(
            "--restart", help="Stop and start workers even where one could switch role in place."
        ),
    ] = False,
    target: Target = None,
) -> None:
    """Move capacity between roles: a worker of a shrinking role switches to a growing one in
    place (no restart) where their shapes match, else workers are drained, stopped and started.
    Says which it did."""
    from deploy.cli import cluster_client as client

    with checked_options():
        check_count(prefill, "--prefill", 0)
        check_count(decode, "--decode", 1)
        check_seconds(timeout, "--timeout", allow_zero=True)
    with router_for(target, admin=True) as addr:
        r = client.rebalance(addr, prefill, decode, timeout, restart)
    console.print(
        f"{r.message}; switched {list(r.switched)}, started {list(r.started)}, "
        f"stopped {list(r.stopped)}",
        markup=False, highlight=False,
    )  # fmt: skip
    if r.message.startswith("rebalance stopped"):
        raise typer.Exit(1)


def switch(
    worker_id: Annotated[str, typer.Argument(help="Worker to switch (see `pdserve status`).")],
    role: Annotated[str, typer.Argument(help="Its new role: prefill, decode or split.")],
    timeout: DrainTimeout = None,
    force: Annotated[
        bool, typer.Option("--force", help="Switch even the last ready worker of its role.")
    ] = False,
    target: Target = None,
) -> None:
    """Switch a worker's role in place, keeping its model and KV pool: it drains its current
    role's work, flips, and admits as the new role. Exits 1 when refused (a draining worker,
    the last of its role, ...: nothing changed) or when its requests outlast the timeout."""
    from deploy.cli import cluster_client as client

    if timeout is not None:
        with checked_options():
            check_seconds(timeout, "--timeout", allow_zero=True)
    with router_for(target, admin=True) as addr:
        r = client.switch(addr, worker_id, role, timeout, force)
    console.print(r.message, markup=False, highlight=False)
    if not r.switched:
        raise typer.Exit(1)


def drain(
    worker_id: Annotated[str, typer.Argument(help="Worker to drain (see `pdserve status`).")],
    stop: Annotated[
        bool, typer.Option(help="Stop the worker once drained (else it stays, idle).")
    ] = True,
    timeout: DrainTimeout = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Drain even the last ready worker of its role."),
    ] = False,
    target: Target = None,
) -> None:
    """Stop admitting on a worker, finish its in-flight requests, then (by default) stop it.
    Exits 1 unless every request it held finished in time."""
    from deploy.cli import cluster_client as client

    if timeout is not None:
        with checked_options():
            check_seconds(timeout, "--timeout", allow_zero=True)
    with router_for(target, admin=True) as addr:
        r = client.drain(addr, worker_id, stop, timeout, force)
    console.print(r.message, markup=False, highlight=False)
    if not r.drained:
        raise typer.Exit(1)


def undrain(
    worker_id: Annotated[str, typer.Argument(help="A draining or drained worker.")],
    target: Target = None,
) -> None:
    """Put a draining or drained (not stopped) worker back into service."""
    from deploy.cli import cluster_client as client

    with router_for(target, admin=True) as addr:
        r = client.undrain(addr, worker_id)
    console.print(r.message or f"{worker_id} is admitting again", markup=False, highlight=False)


COMMANDS = (rebalance, switch, drain, undrain)
"""This module's commands, in the order `pdserve --help` lists them."""
