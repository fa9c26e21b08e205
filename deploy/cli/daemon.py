"""Run `pdserve up` in the foreground or as a detached daemon, and find it again.

The process that runs the cluster (foreground, or the daemon `--detach` starts) writes a state
file (`~/.cache/pdserve/run/cluster.json`, or `$PDSERVE_STATE_FILE`: pid, gRPC targets, admin
planes, metrics, Redis, Ray address, log, and with API keys on the CLI's admin key) once the
API answers, and removes it when it stops. It holds secrets (the admin key, Redis's password):
it is written readable by its user only (0600). While it
runs it appends the controller's events (worker lifecycle, planner actions) to the control log
next to the state file, which `pdserve status` shows. `pdserve down` sends that pid SIGTERM,
which stops routers, the controller with its workers, Ray and the embedded Redis in order.
Other commands read the target from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy.checkpoints.make_model import cache_dir


class NoCluster(LookupError):
    """A command that talks to a router got no --target and no cluster's state file."""

    def __init__(self) -> None:
        super().__init__("no cluster is running (`pdserve up` starts one)")


@dataclass(frozen=True)
class ClusterState:
    pid: int
    targets: list[str]
    metrics: list[str]
    redis_url: str
    model_dir: str
    log: str
    ray_address: str = ""
    ray_external: bool = False
    """The Ray cluster was there before `up` (`--address`) and outlives it."""
    cluster_name: str = "pdserve"
    """`cluster.name`: the Ray namespace of the cluster's actors."""
    control_log: str = ""
    """File the controller's events are appended to (`pdserve status` shows its tail)."""
    admin_targets: list[str] = field(default_factory=list)
    """Each router's admin plane (HOST:PORT), in the order of `targets`."""
    admin_key: str = ""
    """The key the CLI sends on the admin plane ("" with API keys off). Secret."""
    tls_ca: str = ""
    """PEM file the CLI verifies the routers' TLS certificate with ("" without TLS)."""

    def __repr__(self) -> str:  # never print the admin key or Redis's password
        return f"ClusterState(pid={self.pid}, targets={self.targets})"

    @property
    def target(self) -> str:
        return self.targets[0]


def foreground_state(
    cluster: Any, endpoint: Any, log_file: Path | None, control_log: Path
) -> ClusterState:
    """The state file's record of a cluster this process started (`pdserve up` in the
    foreground): `cluster` a started `deploy.control.launch.Cluster`, `endpoint` its start's."""
    config = cluster.config
    return ClusterState(
        pid=os.getpid(),
        targets=list(endpoint.grpc),
        metrics=list(endpoint.metrics),
        redis_url=endpoint.redis_url,
        model_dir=endpoint.model_dir,
        log=str(log_file or ""),
        ray_address=endpoint.ray_address,
        ray_external=config.cluster.address is not None,
        cluster_name=config.cluster.name,
        control_log=str(control_log),
        admin_targets=list(endpoint.admin),
        admin_key=cluster.access.admin_key,
        tls_ca=os.environ.get("PDSERVE_TLS_CA") or config.router.tls.cert_file,
    )


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


def new_control_log() -> Path:
    """The controller's event log beside the state file, made empty, its folder too (a
    foreground `up` on a fresh machine, or in a fresh container, has none yet)."""
    path = state_path().parent / "pdserve-control.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def write_state(state: ClusterState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(state), indent=2))
    os.replace(tmp, path)


def clear_state(pid: int) -> None:
    path = state_path()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (FileNotFoundError, ValueError):
        pass


def resolve_target(target: str | None) -> str:
    """--target, else the running cluster's first router; NoCluster when neither."""
    if target:
        return target
    state = read_state()
    if state is None:
        raise NoCluster()
    return state.target


def _alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie counts as gone: it is reaped here when it is our child
    (the daemon `up --detach` spawned from a process that lives on, e.g. a test)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class SignalFlag:
    """Set by the signals given while installed (`with SignalFlag(SIGINT) as flag:`), waited on
    without locks. A handler must not call `threading.Event.set`: it runs in the main thread
    between two bytecodes, possibly inside that same event's `wait` while it holds the event's
    (non-reentrant) lock, and then waits for itself forever (Python's signal docs warn of it;
    `status --watch` once did not exit on Ctrl-C in a loaded CI run, with such a handler; not
    reproduced since). The handler here only assigns; `wait` sleeps in short slices."""

    SLICE_S = 0.05

    def __init__(self, *signums: int) -> None:
        self.signums = signums or (signal.SIGINT,)
        self.is_set = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        self.is_set = True

    def install(self) -> SignalFlag:
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __enter__(self) -> SignalFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds` or until a signal came; whether one came."""
        deadline = time.monotonic() + seconds
        while not self.is_set:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, self.SLICE_S))
        return self.is_set


def wait_for_signal(on_idle: Callable[[], None] | None = None, every_s: float = 1.0) -> None:
    """Block until SIGINT or SIGTERM, calling `on_idle` about every `every_s` seconds."""
    # left installed: a second signal while the caller shuts down is absorbed, not fatal
    stop = SignalFlag(signal.SIGTERM, signal.SIGINT).install()
    while not stop.wait(every_s):
        if on_idle is not None:
            on_idle()


class ControlLogFollower:
    """Appends the controller's new events, and every planner decision, to the control log
    (called by the process running `up`). Planner lines start with "planner tick"."""

    def __init__(self, cluster: Any, path: Path) -> None:
        self.cluster = cluster
        self.path = path
        self.seq = 0
        self.tick = 0

    def poll(self) -> None:
        lines: list[str] = []
        try:
            self.seq, events = self.cluster.control_log(self.seq)
            lines += events
            decisions = self.cluster.planner_decisions(self.tick)
        except Exception:  # the controller is busy or gone: try again next time
            decisions = []
        if decisions:
            self.tick = decisions[-1][0] + 1
            lines += [_planner_line(line) for _, line in decisions]
        if lines:
            with self.path.open("a") as f:
                f.writelines(line + "\n" for line in lines)


def _planner_line(line: str) -> str:
    clock, _, rest = line.partition(" ")
    return f"{clock} planner {rest}"


def tail(path: str, n: int) -> list[str]:
    """The last `n` lines of a file (none when it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def spawn_detached(argv: list[str], log_path: Path, timeout_s: float) -> ClusterState:
    """Start `pdserve up ARGV` in a new session and wait until it wrote its state file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    previous = read_state()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli.app", "up", *argv, "--log-file", str(log_path)],
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
        if state.ray_external and state.ray_address:
            # The detached controller (and its workers) outlive the killed driver there.
            from deploy.control.launch import remove_leftovers

            remove_leftovers(state.ray_address, state.cluster_name)
    clear_state(state.pid)
    return state
