"""What every `pdserve` command module shares (deploy/cli/app.py, deploy/cli/inspect_commands.py):
the consoles, the one-line failure and its exit code, and the router a command talks to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from deploy.cli import cluster_client as client

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr (never wrapped), then exit `code`."""
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


@contextmanager
def checked_options() -> Iterator[None]:
    """A refused option (typer.BadParameter from deploy.cli.options) is one line and exit 2."""
    try:
        yield
    except typer.BadParameter as e:
        fail(e.message, 2)


@contextmanager
def router_for(target: str | None, admin: bool = False) -> Iterator[client.Target]:
    """The router a command talks to (--target, else the running cluster's first; its admin
    plane with `admin`), with the key and TLS files to call it with. No cluster, nothing
    answering there, and an RPC the server refused are each one line on stderr and exit 1;
    every command that talks to a router goes through here."""
    import grpc

    from deploy.cli import cluster_client as client
    from deploy.cli import daemon

    try:
        yield client.resolve(target, admin)
    except (daemon.NoCluster, client.NoRouter) as e:
        fail(str(e), 1)
    except grpc.RpcError as e:
        line = client.rpc_error_line(e)
        if admin and isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
            line += " (no admin plane at this address: it has its own port, --admin-port)"
        fail(line, 1)
