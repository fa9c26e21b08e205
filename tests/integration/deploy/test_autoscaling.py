"""Planner + Ray autoscaler on `ray.cluster_utils.AutoscalingCluster`: a load surge makes the
planner ask for a prefill worker, the fake autoscaler adds a node, the new worker serves
requests, and idle scale-down follows; `up --address` / `down` on that external Ray (see
autoscale_scenario.py for the whole story).

The scenario runs in its own PID, network and mount namespaces (`unshare`, root only): the
fake cluster runs `ray stop --force` and binds port 6379, which must not touch the other Ray
clusters on this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("autoscale_scenario.py")
REPO = Path(__file__).parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


def _namespaces_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-p", "-f", "--mount-proc", "-n", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _namespaces_available(), reason="needs root and unshare (namespaces)")
def test_surge_scales_prefill_up_onto_a_new_node_then_idle_scales_down(
    tiny_model_dir: Path,
) -> None:
    inner = (
        # private Ray session files, temp files and shared memory; /tmp itself stays (the
        # checkout, its venv or the model may live there)
        "set -e; ip link set lo up; "
        "mkdir -p /tmp/ray; mount -t tmpfs -o size=1g tmpfs /tmp/ray; "
        "export TMPDIR=/tmp/ray PYTHONUNBUFFERED=1; "
        "mount -t tmpfs -o size=1g tmpfs /dev/shm; "
        f'"{sys.executable}" "{SCENARIO}" "{tiny_model_dir}"'
    )
    # --kill-child: when the test gives up, the namespace's init and with it every process
    # of the scenario die too (else its Ray cluster outlives the test)
    command = ["unshare", "-p", "-f", "--kill-child", "--mount-proc", "-n", "bash", "-c", inner]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"scenario still running after 600 s:\n{out[-4000:]}\n{err[-4000:]}")
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-4000:] + "\n" + done.stderr[-6000:]
    assert "SCENARIO OK" in done.stdout
