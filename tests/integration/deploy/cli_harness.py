"""Driving a `pdserve up --detach` daemon from tests: the CLI in-process (`CliRunner`) with
`PDSERVE_STATE_FILE` in a temp folder, status polling, and killing an actor from a separate
driver process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

KV_BLOCKS = 96
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class CliCluster:
    """The running daemon: its folder, config, and a runner bound to its state file."""

    folder: Path
    config_path: Path
    env: dict[str, str]
    up_output: str

    @property
    def state_file(self) -> Path:
        return Path(self.env["PDSERVE_STATE_FILE"])

    def state(self) -> dict[str, Any]:
        return dict(json.loads(self.state_file.read_text()))

    @property
    def target(self) -> str:
        return str(self.state()["targets"][0])

    def cli(self, *args: str) -> Any:
        """Run `pdserve ARGS` in-process; returns the click Result."""
        from deploy.cli.app import app

        return CliRunner().invoke(app, list(args), env=self.env, catch_exceptions=False)

    def status(self) -> dict[str, Any]:
        result = self.cli("status", "--json")
        assert result.exit_code == 0, result.output
        # (the JSON; a line an actor of this test process's Ray logs meanwhile may follow it)
        return dict(json.JSONDecoder().raw_decode(result.output)[0])

    def workers(self, role: str | None = None) -> list[dict[str, Any]]:
        return [w for w in self.status()["workers"] if role is None or w["role"] == role]

    def wait_for(self, predicate: Any, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = self.status()
            if predicate(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"{what} not within {timeout_s:.0f}s; last status: {last}")

    def ray_kill(self, actor_name: str) -> float:
        """`ray.kill` an actor of the cluster from a separate driver (this test process keeps
        its own Ray, if any, untouched); returns the wall-clock time of the kill."""
        code = (
            "import os, sys, time, ray\n"
            "ray.init(address=sys.argv[1], namespace='pdserve', log_to_driver=False)\n"
            "ray.kill(ray.get_actor(sys.argv[2]))\n"
            "print(time.time(), flush=True)\n"
            "os._exit(0)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, self.state()["ray_address"], actor_name],
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
        )
        return float(done.stdout.split()[-1])
