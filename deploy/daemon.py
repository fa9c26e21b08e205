"""Run `pdserve up` in the foreground or as a detached daemon, and find it again.

The process that runs the cluster (foreground, or the daemon `--detach` starts) writes a state
file (`~/.cache/pdserve/run/cluster.json`: pid, gRPC targets, metrics, Redis, log) once the
API answers, and removes it when it stops. `pdserve down` sends that pid SIGTERM, which stops
routers, workers, Ray and the embedded Redis in order. Other commands read the target from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deploy.make_model import cache_dir

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass(frozen=True)
class ClusterState:
    pid: int
    targets: list[str]
    metrics: list[str]
    redis_url: str
    model_dir: str
    log: str

    @property
    def target(self) -> str:
        return self.targets[0]


def state_path() -> Path:
    return Path(os.environ.get("PDSERVE_STATE_FILE") or cache_dir() / "run" / "cluster.json")


def read_state() -> ClusterState | None:
    path = state_path()
    try:
        state = ClusterState(**json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None
    if not _alive(state.pid):
        path.unlink(missing_ok=True)  # stale: the process is gone
        return None
    return state


def write_state(state: ClusterState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    os.replace(tmp, path)


def clear_state(pid: int) -> None:
    path = state_path()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (FileNotFoundError, ValueError):
        pass


def resolve_target(target: str | None) -> str:
    """--target, else the running cluster's, else 127.0.0.1:50051."""
    if target:
        return target
    state = read_state()
    return state.target if state else DEFAULT_TARGET


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop.is_set():
        stop.wait(0.5)


def spawn_detached(argv: list[str], log_path: Path, timeout_s: float) -> ClusterState:
    """Start `pdserve up ARGV` in a new session and wait until it wrote its state file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    previous = read_state()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "up", *argv, "--log-file", str(log_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state()
        if state is not None and state.pid == proc.pid and state != previous:
            return state
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"pdserve up exited with {proc.returncode}:\n{tail}")
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError(f"cluster not up after {timeout_s:.0f}s; see {log_path}")


def stop_cluster(timeout_s: float = 120.0) -> ClusterState | None:
    """SIGTERM the running cluster's process and wait for it; None if none runs."""
    state = read_state()
    if state is None:
        return None
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(state.pid):
        time.sleep(0.2)
    if _alive(state.pid):
        os.killpg(os.getpgid(state.pid), signal.SIGKILL)
    clear_state(state.pid)
    return state
