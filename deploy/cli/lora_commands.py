"""`pdserve lora load|unload|list`: the LoRA adapters a running cluster serves, through the
router's admin plane (router/servicer.py → the controller → every worker;
deploy/control/lora_admin.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from deploy.cli.command_support import checked_options, console, router_for
from deploy.cli.options import check_seconds

if TYPE_CHECKING:
    from pdserve.v1 import serving_pb2 as pb

app = typer.Typer(help="LoRA adapters the cluster serves.", no_args_is_help=True)

Target = Annotated[str | None, typer.Option(help="HOST:PORT (default: running cluster).")]
Timeout = Annotated[float, typer.Option(help="Seconds to wait for every worker.")]


@app.command("load")
def load(
    name: Annotated[str, typer.Argument(help="Name requests use (gRPC `lora`, HTTP `model`).")],
    path: Annotated[Path, typer.Argument(help="PEFT adapter folder on the workers' disk.")],
    target: Target = None,
    timeout: Timeout = 60.0,
) -> None:
    """Serve a PEFT adapter on every worker (and every worker started later)."""
    from deploy.cli import cluster_client as client

    status = _change(
        target, timeout, lambda addr: client.load_lora(addr, name, str(path.resolve()), timeout)
    )
    _print(status, as_json=False)


@app.command("unload")
def unload(
    name: Annotated[str, typer.Argument(help="Adapter to stop serving.")],
    target: Target = None,
    timeout: Timeout = 60.0,
) -> None:
    """Stop serving an adapter (requests running on it finish)."""
    from deploy.cli import cluster_client as client

    _change(target, timeout, lambda addr: client.unload_lora(addr, name, timeout))


def _change(
    target: str | None, timeout: float, call: Callable[[Any], pb.LoraStatus]
) -> pb.LoraStatus:
    """Check --timeout, run `call` against the router's admin plane, print its message."""
    with checked_options():
        check_seconds(timeout, "--timeout", allow_zero=False)
    with router_for(target, admin=True) as addr:
        status = call(addr)
    console.print(status.message)
    return status


@app.command("list")
def list_(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    target: Target = None,
    timeout: Timeout = 30.0,
) -> None:
    """The adapters the cluster serves, and the workers holding each."""
    from deploy.cli import cluster_client as client

    with router_for(target, admin=True) as addr:
        status = client.list_loras(addr, timeout)
    _print(status, as_json)


def _print(status: pb.LoraStatus, as_json: bool) -> None:
    rows = [
        {
            "name": a.name,
            "path": a.path,
            "rank": a.rank,
            "workers": list(a.workers),
            "loaded_on": list(a.loaded_on),
        }
        for a in status.adapters
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("no LoRA adapters loaded")
        return
    table = Table("name", "rank", "path", "workers", "weights held on")
    for r in rows:
        table.add_row(
            r["name"], str(r["rank"]), r["path"], ", ".join(r["workers"]), ", ".join(r["loaded_on"])
        )
    console.print(table)
