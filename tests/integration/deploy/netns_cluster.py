"""A Ray cluster of "hosts" on one machine: each node a network namespace of its own, joined by
a Linux bridge over veth pairs, so Ray, Redis and NIXL/UCX traffic between nodes crosses a
real link with its own addresses (root only; `ip netns`).

    with NetnsCluster.create([NodeSpec("head", ...), NodeSpec("p1", ...), ...]) as c:
        c.start_ray()            # `ray start --head` on the first, `--address` on the rest
        c.run("head", [...])     # a command in a node's namespace
        c.link_down("d1")        # the node's interface down: it drops off the network
        kill_namespace(c.ns("d2"))   # every process of the node killed (raylet, workers)
        c.shape("p1", ["netem", "delay", "20ms"])   # a slow link: a root qdisc on its interface

Everything made here is named with a per-run prefix (`pd<pid>`) and removed by `close()`:
every qdisc still on a node's interface, every process left in the namespaces (`ip netns
pids`: they are ours; `ray stop` is never used, it would kill every Ray of the machine), the
namespaces, the bridge. `ip netns exec`
gives each namespace its own /sys too, so a node's interface counters are read from inside.

Inside a node, UCX is limited to TCP on the node's interface (`UCX_TLS=tcp`,
`UCX_NET_DEVICES=eth0`): the namespaces share the machine's /dev/shm, so with shm allowed UCX
would take the shortcut and the KV would never cross the link.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RAY_PORT = 6379
REDIS_PORT = 6380


@dataclass(frozen=True)
class NodeSpec:
    """One host: its name (also the namespace's suffix), Ray CPUs and custom resources."""

    name: str
    num_cpus: float = 1
    resources: dict[str, float] = field(default_factory=dict)


def namespaces_work() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    probe = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def namespace_pids(ns: str) -> list[int]:
    """Every process in network namespace `ns` (`ip netns pids`)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          timeout=10)  # fmt: skip
    return [int(p) for p in done.stdout.split()]


def kill_namespace(ns: str, timeout_s: float = 10) -> int:
    """SIGKILL every process of namespace `ns` until none is left (a process that forked
    between the listing and the kill is caught on the next pass); how many were killed."""
    killed = 0
    deadline = time.monotonic() + timeout_s
    while pids := namespace_pids(ns):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} processes of {ns} outlived SIGKILL: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.1)
    return killed


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class NetnsCluster:
    """The namespaces, bridge and links of one run, and the processes started in them."""

    def __init__(self, nodes: Sequence[NodeSpec], subnet: int) -> None:
        self.prefix = f"pd{os.getpid() % 100000}"
        self.nodes = {n.name: n for n in nodes}
        self.head = nodes[0].name
        self.subnet = subnet
        self.bridge = f"{self.prefix}br"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.ray_tmp = self.workdir / "ray"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- topology -------------------------------------------------------------------------

    @classmethod
    def create(cls, nodes: Sequence[NodeSpec]) -> NetnsCluster:
        """Namespaces, veth pairs and the bridge, addresses 10.213.S.1.. in node order."""
        cluster = cls(nodes, subnet=100 + os.getpid() % 150)
        try:
            cluster._build()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def ip(self, node: str) -> str:
        return f"10.213.{self.subnet}.{list(self.nodes).index(node) + 1}"

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(f"link:{self.bridge}")
        _ip("link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            ns, host_end = self.ns(node), f"{self.prefix}v{i}"
            _ip("netns", "add", ns)
            self._made.append(f"netns:{ns}")
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(f"link:{host_end}")
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("addr", "add", f"{self.ip(node)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            # A default route, as a host has (out of the bridge it leads nowhere): Ray finds a
            # process's own address by routing towards a public one, and without a route a
            # driver falls back to another address than its node's and joins another raylet.
            _ip("route", "add", "default", "dev", "eth0", ns=ns)

    # -- processes ------------------------------------------------------------------------

    def env(self, node: str) -> dict[str, str]:
        """The environment of every process on `node` (Ray's workers inherit the raylet's)."""
        return {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
        }

    def argv(self, node: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def run(self, node: str, argv: Sequence[str], timeout_s: float = 120, **kw: Any) -> str:
        """Run `argv` on `node` to its end (within `timeout_s`); its stdout."""
        done = subprocess.run(
            self.argv(node, argv), env=self.env(node), capture_output=True, text=True,
            timeout=timeout_s, **kw,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} on {node} exited {done.returncode}: "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )
        return done.stdout

    def spawn(self, node: str, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        """Start `argv` on `node` in the background, output to workdir/LOG."""
        out = open(self.workdir / log, "wb")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen(
            self.argv(node, argv), env=self.env(node), stdout=out, stderr=subprocess.STDOUT
        )
        self._procs.append(proc)
        return proc

    def start_redis(self) -> str:
        """A redis-server on the head's address (every node reaches it); its URL."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no redis-server on PATH (apt-get install redis-server)")
        self.spawn(self.head, [binary, "--bind", self.ip(self.head), "--port", str(REDIS_PORT),
                               "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                   "redis.log")  # fmt: skip
        url = f"redis://{self.ip(self.head)}:{REDIS_PORT}"
        self._wait(lambda: self._redis_answers(url), 20, "redis-server on the head")
        return url

    def _redis_answers(self, url: str) -> bool:
        probe = "import redis,sys; redis.Redis.from_url(sys.argv[1], socket_timeout=1).ping()"
        try:
            self.run(self.head, [os.environ.get("PYTHON", "python"), "-c", probe, url], 10)
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return True

    @property
    def ray_address(self) -> str:
        return f"{self.ip(self.head)}:{RAY_PORT}"

    def start_ray(self, timeout_s: float = 180) -> None:
        """`ray start --head` on the head, then `ray start --address` on every other node, as
        an operator does; returns once every node is alive in the GCS."""
        ray = shutil.which("ray") or "ray"
        for node, spec in self.nodes.items():
            common = [
                f"--node-ip-address={self.ip(node)}", f"--num-cpus={spec.num_cpus:g}",
                f"--resources={json.dumps(spec.resources)}", "--object-store-memory=80000000",
                "--disable-usage-stats",
            ]  # fmt: skip
            if node == self.head:
                argv = [ray, "start", "--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                        f"--temp-dir={self.ray_tmp}", *common]  # fmt: skip
            else:
                argv = [ray, "start", f"--address={self.ray_address}", *common]
            self._ray_start(node, argv, timeout_s)
        self._wait(lambda: self.alive_nodes() == len(self.nodes), timeout_s, "every Ray node")

    def _ray_start(self, node: str, argv: list[str], timeout_s: float, attempts: int = 5) -> None:
        """`ray start` on `node`, again from scratch when it fails: it gives its raylet a fixed
        30 s to register with the GCS, which a loaded 2-core machine can miss."""
        for attempt in range(1, attempts + 1):
            try:
                self.run(node, argv, timeout_s)
                return
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if attempt == attempts:
                    raise
                print(f"[netns] ray start on {node} failed (attempt {attempt}): "
                      f"{str(e)[-300:]}", flush=True)  # fmt: skip
                self.kill_node(node)
                time.sleep(2)

    def rejoin(self, node: str, timeout_s: float = 180) -> None:
        """`node` back in the cluster as a new Ray node (what is left of the old one killed):
        the GCS declares a node dead that it could not reach, and that one never comes back."""
        spec = self.nodes[node]
        self.kill_node(node)
        ray = shutil.which("ray") or "ray"
        self._ray_start(node, [
            ray, "start", f"--address={self.ray_address}", f"--node-ip-address={self.ip(node)}",
            f"--num-cpus={spec.num_cpus:g}", f"--resources={json.dumps(spec.resources)}",
            "--object-store-memory=80000000", "--disable-usage-stats"], timeout_s)  # fmt: skip

    def alive_nodes(self) -> int:
        """Nodes the GCS holds alive (asked from the head with the `ray` state CLI's API)."""
        code = (
            "import sys, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "print(sum(1 for n in ray.nodes() if n['Alive']))\n"
        )
        try:
            out = self.run(self.head, [os.environ.get("PYTHON", "python"), "-c", code,
                                       self.ray_address], 60)  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired):
            return -1
        return int(out.split()[-1])

    # -- faults and counters --------------------------------------------------------------

    def link_down(self, node: str) -> None:
        _ip("link", "set", "eth0", "down", ns=self.ns(node))

    def link_up(self, node: str) -> None:
        _ip("link", "set", "eth0", "up", ns=self.ns(node))

    def rx_bytes(self, node: str) -> int:
        """Bytes `node`'s interface has received (its own /sys, through `ip netns exec`)."""
        return int(self.run(node, ["cat", "/sys/class/net/eth0/statistics/rx_bytes"], 10))

    def pids(self, node: str) -> list[int]:
        return namespace_pids(self.ns(node))

    def kill_node(self, node: str, sig: int = signal.SIGKILL) -> int:
        """Signal every process of `node` (all ours: the namespace is); how many there were."""
        pids = self.pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return len(pids)

    # -- link shaping ---------------------------------------------------------------------
    # A qdisc on the interface inside the node's namespace shapes what the node sends: on
    # the prefill node, every KV hand-off to another node (traffic between two processes of
    # one node goes over its loopback, unshaped).

    def _tc(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns(node), "tc", *args],
                              capture_output=True, text=True, timeout=30)  # fmt: skip

    def qdisc_refusal(self, node: str, qdisc: Sequence[str]) -> str | None:
        """Why `qdisc` cannot shape `node`'s interface (no `tc`; the kernel has no such
        qdisc), or None when it can (tried on the interface and removed again)."""
        if shutil.which("tc") is None:
            return "no `tc` (iproute2) on PATH"
        added = self._tc(node, "qdisc", "add", "dev", "eth0", "root", *qdisc)
        if added.returncode != 0:
            return f"`tc qdisc add ... {' '.join(qdisc)}`: {added.stderr.strip()}"
        self._tc(node, "qdisc", "del", "dev", "eth0", "root")
        return None

    def shape(self, node: str, qdisc: Sequence[str]) -> None:
        """`qdisc` (tc's words, e.g. ["netem", "delay", "20ms"]) as the root qdisc of
        `node`'s interface, until `unshape` (or `close`)."""
        done = self._tc(node, "qdisc", "add", "dev", "eth0", "root", *qdisc)
        if done.returncode != 0:
            raise RuntimeError(f"tc qdisc add on {node}: {done.stderr.strip()}")
        self._made.append(f"qdisc:{node}")

    def unshape(self, node: str) -> None:
        """`node`'s interface back to its default qdisc (nothing when it has none of ours)."""
        if f"qdisc:{node}" in self._made:
            self._tc(node, "qdisc", "del", "dev", "eth0", "root")
            self._made.remove(f"qdisc:{node}")

    def qdisc_drops(self, node: str) -> int:
        """Packets the root qdisc of `node`'s interface dropped (`tc -s`: loss and overflow)."""
        shown = self._tc(node, "-s", "qdisc", "show", "dev", "eth0", "root").stdout
        found = re.search(r"dropped (\d+)", shown)
        return int(found.group(1)) if found else 0

    # -- teardown -------------------------------------------------------------------------

    def keep_logs(self, to: Path) -> None:
        """Copy the run's logs (Ray's session logs, pdserve's, redis-server's) to `to`."""
        shutil.rmtree(to, ignore_errors=True)
        shutil.copytree(self.workdir, to, ignore=shutil.ignore_patterns("sockets", "*.sock"),
                        ignore_dangling_symlinks=True, symlinks=True)  # fmt: skip

    def close(self) -> None:
        """Remove the qdiscs, kill every process in the namespaces, then remove namespaces,
        links and files."""
        for made in [m for m in self._made if m.startswith("qdisc:")]:
            self.unshape(made.split(":", 1)[1])
        for node in self.nodes:
            if f"netns:{self.ns(node)}" in self._made:
                self.kill_node(node)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            self.pids(n) for n in self.nodes if f"netns:{self.ns(n)}" in self._made
        ):
            time.sleep(0.2)
        for made in reversed(self._made):
            kind, name = made.split(":", 1)
            argv = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(argv, capture_output=True, timeout=30)
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _wait(ok: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{what} not up within {timeout_s:.0f} s")
