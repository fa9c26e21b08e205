"""`pdserve up` on a local Ray refuses, at once and saying what is short, workers that could
never be placed (a local Ray has no autoscaler: they would wait until the start timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from cli_harness import free_port

REPO = Path(__file__).parents[3]


def test_up_refuses_workers_that_a_local_ray_cannot_place(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = tmp_path / "pdserve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "grpc_port": free_port(),
                "metrics_port": 0,
                "engine": {"device": "cpu", "num_kv_blocks": 64},
                # every worker asks for a node type this machine does not have
                "placement": {"default": {"num_cpus": 0, "resources": {"gpu-node": 1}}},
            }
        )
    )
    env = {**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "run" / "cluster.json")}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli.app", "up", "--config", str(config), "--decode", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, output
    assert (
        "cluster failed to start: the workers need 3 gpu-node (decode 2, prefill 1) but this "
        "Ray has 0" in output
    ), output
    assert time.monotonic() - start < 60  # Ray's start-up, not a worker start timeout
    assert not (tmp_path / "run" / "cluster.json").exists()
