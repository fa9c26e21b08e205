"""Every command that talks to a router says plainly when there is none: no state file and no
--target is "no cluster is running", a target where nothing listens is "no pdserve router
answers at HOST:PORT"; one line on stderr, exit 1. (They printed gRPC's raw connection error,
after trying 127.0.0.1:50051 whether or not a cluster had been started.)"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.cli.app import app

COMMANDS = {
    "status": ["status"],
    "status --json": ["status", "--json"],
    "generate": ["generate", "hello"],
    "drain": ["drain", "decode-0"],
    "undrain": ["undrain", "decode-0"],
    "rebalance": ["rebalance", "--prefill", "1", "--decode", "1"],
    "thresholds": ["thresholds"],
    "set thresholds": ["thresholds", "--max-queue-wait-ms", "0"],
}
NO_CLUSTER = "error: no cluster is running (`pdserve up` starts one)\n"


def free_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_router(target: str) -> str:
    return (
        f"error: no pdserve router answers at {target} (is the cluster up? `pdserve up` "
        "starts one)\n"
    )


def cli(state_file: Path, *args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"PDSERVE_STATE_FILE": str(state_file)})


@pytest.mark.parametrize("command", COMMANDS)
def test_without_a_state_file_or_target_no_cluster_is_running(tmp_path: Path, command: str) -> None:
    result = cli(tmp_path / "run" / "cluster.json", *COMMANDS[command])
    assert result.exit_code == 1
    assert result.output == NO_CLUSTER


def test_bench_without_a_cluster_says_so_too(tmp_path: Path) -> None:
    result = cli(tmp_path / "cluster.json", "bench", "--out", str(tmp_path / "out"))
    assert (result.exit_code, result.output) == (1, NO_CLUSTER)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_target_where_nothing_listens_names_the_address(tmp_path: Path, command: str) -> None:
    target = f"127.0.0.1:{free_port()}"
    result = cli(tmp_path / "cluster.json", *COMMANDS[command], "--target", target)
    assert result.exit_code == 1
    # generate echoes its prompt before it learns that nobody answers
    assert result.output.removeprefix("hello\n") == no_router(target)


def test_a_running_clusters_router_that_does_not_answer_is_named(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    state_file = tmp_path / "cluster.json"
    state = {"pid": os.getpid(), "targets": [target], "metrics": [], "redis_url": "",
             "model_dir": "", "log": ""}  # fmt: skip
    state_file.write_text(json.dumps(state))
    result = cli(state_file, "status")
    assert (result.exit_code, result.output) == (1, no_router(target))
