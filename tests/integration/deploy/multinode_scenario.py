"""pdserve on a Ray cluster of four "hosts" joined by real links (network namespaces, veth pairs,
a bridge: tests/integration/deploy/netns_cluster.py), started as an operator starts one, and
the faults only a network shows. Root only; scripts/multinode.sh runs it as its own CI step.

    python tests/integration/deploy/multinode_scenario.py [--out FILE.json]

Hosts: `head` (Ray head, redis-server, `pdserve up`, the controller and the router), `p1`
(Ray resource `prefill: 1`), `d1` and `d2` (`decode: 1` each). Story (prints
`SCENARIO OK {json}` at the end, exits non-zero with the reason otherwise; exit 3 with
`SCENARIO SKIP reason` where namespaces cannot be made):

1. `ray start --head` / `ray start --address` in the namespaces; `pdserve up --detach
   --address HEAD:6379 --redis-url ...` on the head; the prefill worker runs on p1, a decode
   worker on each of d1 and d2, the controller and the router on the head;
2. greedy requests: tokens equal to transformers' float32 greedy run on one host; the KV
   hand-off crossed a veth (UCX over TCP only: the decode nodes' interfaces received at least
   the bytes the decode workers report pulled); hand-off GB/s;
3. the same hand-off payloads pulled from p1 across the veth and within p1's namespace (a probe
   decode worker there), side by side (handoff_probe.py); then again with p1's link slowed (a
   `tc` qdisc on its interface: netem delay and loss, else a tbf rate limit; skipped, saying
   why, where neither can be had), with greedy requests through the router meanwhile, each
   equal to the reference or ended with a clear status within its deadline; the qdisc removed;
4. a decode node's link goes down as soon as four streams run (on both decode nodes): every
   stream completes (migrated to the other decode worker, tokens still equal to the reference) or
   ends with a clear status, within a deadline; the router stops listing the lost worker within
   its stated time and Ray's GCS declares the node dead; no KV block, lease or transfer is
   left on the surviving workers;
5. the link comes back and the node's Ray is started again (`ray start --address`: the GCS had
   declared the old node dead): the controller's replacement decode worker is placed there
   and the cluster serves again with two decode workers, the replacement among them;
6. 4 and 5 again with the other decode node's processes killed (SIGKILL to every process of its
   namespace: its raylet, Ray's daemons, the worker) instead of its link taken down.

The driver's steps (multinode_driver.py, handoff_probe.py) run in the head's namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

import handoff_probe  # noqa: E402
import multinode_driver  # noqa: E402
from netns_cluster import NetnsCluster, NodeSpec, namespaces_work  # noqa: E402

NODES = [
    NodeSpec("head", 1, {"pdserve-router": 1}),
    NodeSpec("p1", 1, {"prefill": 1}),
    NodeSpec("d1", 1, {"decode": 1}),
    NodeSpec("d2", 1, {"decode": 1}),
]
SLOW_LINKS = (
    ("netem", "delay", "20ms", "loss", "1%"),
    ("tbf", "rate", "20mbit", "burst", "32kb", "latency", "50ms"),
)
"""p1's slow link, first choice first: netem's delay and loss; where the kernel has no netem
(no CONFIG_NET_SCH_NETEM, no sch_netem module to load), tbf's rate limit: a 20 Mbit/s link
whose queue drops what would wait past 50 ms."""


def config(model_dir: str) -> dict[str, Any]:
    return {
        "model": model_dir,
        "prefill": 1,
        "decode": 2,
        "engine": {"device": "cpu", "dtype": "float32", "num_kv_blocks": 160,
                   "max_model_len": 1024, "attention_backend": "torch", "cuda_graphs": False},
        # each role on its nodes by Ray's custom resources, the router on the head
        "placement": {"prefill": {"num_cpus": 0, "resources": {"prefill": 1}},
                      "decode": {"num_cpus": 0, "resources": {"decode": 1}}},
        "router_resources": {"pdserve-router": 1},
        "thresholds": {"local_prefill_threshold_tokens": 0},  # every prompt disaggregated
        "router": {"admin_port": 0, "http_port": 0, "metrics_port": 0,
                   "orchestrator": {"token_gap_timeout_s": multinode_driver.TOKEN_GAP_S}},
    }  # fmt: skip


class Scenario:
    """The story, driven from the head's namespace (its loopback reaches the router)."""

    def __init__(self, cluster: NetnsCluster, out: dict[str, Any]) -> None:
        self.c = cluster
        self.out = out
        self.py = sys.executable
        state_file = str(cluster.workdir / "run" / "cluster.json")
        self.env = {
            **cluster.env("head"),
            "PYTHONPATH": str(REPO),
            "PDSERVE_STATE_FILE": state_file,
            "NETNS_RAY_ADDRESS": cluster.ray_address,
        }

    def cli(self, *args: str, timeout_s: float = 600) -> str:
        done = subprocess.run(
            self.c.argv("head", [self.py, "-m", "deploy.cli", *args]), env=self.env,
            capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        )  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"pdserve {' '.join(args)}: {done.stdout}\n{done.stderr}")
        return done.stdout

    def drive(self, step: str, arg: Any = None, timeout_s: float = 300) -> Any:
        """One step of the driver (this file's `--drive STEP`), run in the head's namespace
        so that it reaches Ray, Redis and the router as a process of the head host does."""
        t0 = time.monotonic()
        done = subprocess.run(
            self.c.argv("head", [self.py, __file__, "--drive", step, json.dumps(arg)]),
            env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        )  # fmt: skip
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not result:
            raise AssertionError(
                f"step {step} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        say(f"step {step} took {time.monotonic() - t0:.0f} s")
        return json.loads(result[-1][len("RESULT ") :])

    def run(self) -> None:
        from deploy.checkpoints.make_model import cached_tiny_model

        model_dir = str(cached_tiny_model())
        t0 = time.monotonic()
        say(f"ray start on {', '.join(f'{n} ({self.c.ip(n)})' for n in self.c.nodes)}")
        self.c.start_ray()  # first: a failed `ray start` on the head kills what runs there
        redis_url = self.c.start_redis()
        self.out["ray_nodes_up_s"] = round(time.monotonic() - t0, 1)
        cfg = self.c.workdir / "pdserve.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump(config(model_dir)))
        t1 = time.monotonic()
        say(f"pdserve up --address {self.c.ray_address} on head")
        self.cli("up", "--detach", "--address", self.c.ray_address, "--redis-url", redis_url,
                 "--config", str(cfg), "--timeout", "500")  # fmt: skip
        self.out["pdserve_up_s"] = round(time.monotonic() - t1, 1)
        ips = {self.c.ip(n): n for n in self.c.nodes}

        placed = self.drive("placement", ips)
        assert placed["controller"] == "head" and placed["routers"] == ["head"], placed
        assert sorted(placed["workers"].values()) == ["d1", "d2", "p1"], placed
        self.out["placement"] = placed

        say(f"placed: {placed}")
        rx0 = {n: self.c.rx_bytes(n) for n in ("d1", "d2")}
        greedy = self.drive("greedy", {"model_dir": model_dir})
        rx = {n: self.c.rx_bytes(n) - rx0[n] for n in ("d1", "d2")}
        pulled = greedy["bytes_pulled"]
        assert sum(pulled.values()) > 0, f"no decode worker pulled KV: {greedy}"
        for node in ("d1", "d2"):  # placement may send every request to one of them
            worker = next(w for w, n in placed["workers"].items() if n == node)
            assert rx[node] >= pulled[worker], (
                f"{node} received {rx[node]} bytes on its link, less than the {pulled[worker]} "
                "bytes of KV its decode worker pulled: the hand-off did not cross the veth"
            )
        self.out["greedy"] = {**greedy, "link_rx_bytes": rx}
        say(f"greedy, across the links: {self.out['greedy']}")

        decodes = sorted(w for w, n in placed["workers"].items() if n in ("d1", "d2"))
        self.handoff(model_dir, cfg, decodes[0])
        for fault, worker in (("link_down", decodes[0]), ("node_killed", decodes[1])):
            self.fault(fault, worker, placed["workers"][worker], model_dir, ips)
        self.cli("down", timeout_s=180)

    def handoff(self, model_dir: str, cfg: Path, across: str) -> None:
        """The same payloads across the veth and within p1 (to decode worker `across`, and
        the probe); then across p1's link slowed by the first of SLOW_LINKS the kernel has."""
        arg = {"model_dir": model_dir, "config": str(cfg), "prefill_ns": self.c.ns("p1"),
               "prefill_ip": self.c.ip("p1"), "across": across}  # fmt: skip
        refusals: list[str] = []
        slow = None
        for qdisc in SLOW_LINKS:
            why = self.c.qdisc_refusal("p1", qdisc)
            if why is None:
                slow = qdisc
                break
            refusals.append(why)
        plain = self.drive("handoff", {**arg, "label": "plain", "router_requests": 0,
                                       "keep_probe": slow is not None}, timeout_s=600)  # fmt: skip
        self.out["handoff"] = plain
        say(f"hand-off, across the veth and within p1: {plain}")
        if slow is None:
            self.out["slow_link"] = {"skipped": "; ".join(refusals)}
            say(f"slow link SKIPPED: {'; '.join(refusals)}")
            return
        say(f"p1's link slowed: tc qdisc add dev eth0 root {' '.join(slow)}")
        self.c.shape("p1", slow)
        try:
            under = self.drive("handoff", {**arg, "label": "slow", "router_requests": 4,
                                           "keep_probe": False}, timeout_s=600)  # fmt: skip
            under["qdisc_dropped_packets"] = self.c.qdisc_drops("p1")
        finally:
            self.c.unshape("p1")
        self.out["slow_link"] = {"qdisc": " ".join(slow), "not_available": refusals, **under}
        say(f"hand-off over the slow link (qdisc removed since): {self.out['slow_link']}")

    def fault(
        self, fault: str, worker: str, node: str, model_dir: str, ips: dict[str, str]
    ) -> None:
        """`fault` on decode worker `worker`'s node mid-stream; then the node back (its link
        up, Ray started on it again) and the replacement worker placed there, serving."""
        say(f"{fault} on {node} ({worker}) mid-stream")
        got = self.drive("stream_fault", {"model_dir": model_dir, "worker": worker,
                                          "ns": self.c.ns(node), "fault": fault,
                                          "salt": fault}, timeout_s=900)  # fmt: skip
        self.out[fault] = got
        say(f"{fault} on {node}: {got}")
        t0 = time.monotonic()
        if fault == "link_down":
            self.c.link_up(node)
        self.c.rejoin(node)
        ray_start_s = time.monotonic() - t0
        back = self.drive("rejoined", {"model_dir": model_dir, "ips": ips, "node": node,
                                       "salt": f"{fault}-back"}, timeout_s=500)  # fmt: skip
        back["ray_start_s"] = round(ray_start_s, 1)
        back["since_back_s"] = round(time.monotonic() - t0, 1)
        self.out[f"{fault}_back"] = back
        say(f"{node} back: {back}")


def say(line: str) -> None:
    print(f"[multinode] {line}", flush=True)


STEPS = {**multinode_driver.STEPS, **handoff_probe.STEPS}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drive", nargs=2, metavar=("STEP", "JSON"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.drive:
        step, arg = args.drive
        print("RESULT " + json.dumps(STEPS[step](json.loads(arg))), flush=True)
        os._exit(0)  # skip Ray's driver shutdown (seconds on a loaded machine)
    why = namespaces_work()
    if why is not None:
        print(f"SCENARIO SKIP {why}")
        return 3
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        with NetnsCluster.create(NODES) as cluster:
            try:
                Scenario(cluster, out).run()
            except BaseException:
                log = cluster.workdir / "run" / "pdserve-up.log"
                if log.exists():
                    print(log.read_text()[-6000:], file=sys.stderr)
                logs = REPO / "build" / "multinode-logs"
                cluster.keep_logs(logs)
                print(f"[multinode] the run's logs: {logs}", file=sys.stderr)
                raise
    except Exception:
        traceback.print_exc()
        print(f"SCENARIO FAILED {json.dumps(out)}")
        return 1
    out["total_s"] = round(time.monotonic() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"SCENARIO OK {json.dumps(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
