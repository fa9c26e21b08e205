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
3. a decode node's link goes down as soon as four streams run (on both decode nodes): every
   stream completes (migrated to the other decode worker, tokens still equal to the reference) or
   ends with a clear status, within a deadline; the router stops listing the lost worker; no KV
   block, lease or transfer is left on the surviving workers;
4. the link comes back and the node's Ray is started again (`ray start --address`: the GCS had
   declared the old node dead): the controller's replacement decode worker is placed there
   and the cluster serves again with two decode workers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from netns_cluster import NetnsCluster, NodeSpec, namespaces_work  # noqa: E402

NODES = [
    NodeSpec("head", 1, {"pdserve-router": 1}),
    NodeSpec("p1", 1, {"prefill": 1}),
    NodeSpec("d1", 1, {"decode": 1}),
    NodeSpec("d2", 1, {"decode": 1}),
]
TOKEN_GAP_S = 4.0  # the router's stage deadline between two chunks: migration starts past it
FAULT_DEADLINE_S = 90.0  # every stream ends within this of the link going down
LONG_TOKENS = 200  # the reference recomputes every token: its cost grows with the square


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
                   "orchestrator": {"token_gap_timeout_s": TOKEN_GAP_S}},
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
        done = subprocess.run(
            self.c.argv("head", [self.py, __file__, "--drive", step, json.dumps(arg)]),
            env=self.env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        )  # fmt: skip
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not result:
            raise AssertionError(
                f"step {step} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
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
        decodes = {w: self.c.ns(n) for w, n in placed["workers"].items() if n in ("d1", "d2")}
        fault = self.drive("link_fault", {"model_dir": model_dir, "decodes": decodes},
                           timeout_s=900)  # fmt: skip
        self.out["link_down"] = fault
        down = placed["workers"][fault["worker"]]
        say(f"{down}'s link down: {fault}")

        t2 = time.monotonic()
        self.c.link_up(down)
        self.c.rejoin(down)
        back = self.drive("rejoined", {"model_dir": model_dir, "ips": ips}, timeout_s=400)
        back["since_link_up_s"] = round(time.monotonic() - t2, 1)
        self.out["link_up"] = back
        say(f"{down} back: {back}")
        self.cli("down", timeout_s=180)


def say(line: str) -> None:
    print(f"[multinode] {line}", flush=True)


# --- the driver's steps (run in the head's namespace) -------------------------------------


def _state() -> dict[str, Any]:
    return dict(json.loads(Path(os.environ["PDSERVE_STATE_FILE"]).read_text()))


def _ray() -> Any:
    import ray

    ray.init(address=os.environ["NETNS_RAY_ADDRESS"], namespace=_state()["cluster_name"],
             log_to_driver=False)  # fmt: skip
    return ray


def _workers(ray: Any) -> dict[str, tuple[Any, Any]]:
    from deploy.control.cluster_controller import CONTROLLER_NAME

    controller = ray.get_actor(CONTROLLER_NAME)
    return {info.worker_id: (info, h) for info, h in ray.get(controller.list_workers.remote(),
                                                             timeout=30)}  # fmt: skip


def _node_names(ray: Any, ips: dict[str, str]) -> dict[str, str]:
    """Ray node id -> our host name (by the node's address)."""
    return {n["NodeID"]: ips.get(n["NodeManagerAddress"], "?") for n in ray.nodes()}


def step_placement(ips: dict[str, str]) -> dict[str, Any]:
    ray = _ray()
    from ray._private import state  # the GCS's actor table (the state API needs a dashboard)

    names = _node_names(ray, ips)
    actors = {a["Name"]: names.get(a["Address"]["NodeID"], "?")
              for a in state.actors(actor_state_name="ALIVE").values() if a["Name"]}  # fmt: skip
    return {
        "controller": actors.get("pdserve-controller", "?"),
        "routers": sorted(n for name, n in actors.items() if name.startswith("pdserve-router")),
        "workers": {w: names.get(info.node, "?") for w, (info, _) in _workers(ray).items()},
    }


def _prompts(model_dir: str, n: int, length: int) -> list[list[int]]:
    from deploy.checkpoints.checkpoint_files import CORPUS
    from vocabulary.tokenizer import Tokenizer

    ids = Tokenizer.from_model_dir(Path(model_dir)).encode(CORPUS.read_text())
    return [ids[i * 97 : i * 97 + length] for i in range(n)]


def _stream(target: str, prompt: list[int], max_tokens: int, got: list[int]) -> str:
    """Stream one greedy request into `got`; its end as a status name (OK or the gRPC code)."""
    import grpc

    from deploy.cli.cluster_client import stream_generate
    from pdserve.v1 import serving_pb2 as pb

    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                 ignore_eos=True)  # fmt: skip
    try:
        for msg in stream_generate(target, request, timeout_s=FAULT_DEADLINE_S + 60):
            got.extend(msg.token_ids)
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def _pulled(ray: Any) -> dict[str, int]:
    loads = {w: ray.get(h.load.remote(), timeout=30) for w, (_, h) in _workers(ray).items()}
    return {w: load.transfer_stats.bytes_transferred for w, load in loads.items()
            if load.transfer_stats is not None}  # fmt: skip


def step_greedy(arg: dict[str, Any]) -> dict[str, Any]:
    from tests.references import greedy_reference

    ray = _ray()
    target = _state()["targets"][0]
    reference = greedy_reference(Path(arg["model_dir"]), stop_at_eos=False)
    prompts = _prompts(arg["model_dir"], 6, 200)
    before = _pulled(ray)
    t0 = time.monotonic()
    for prompt in prompts:
        got: list[int] = []
        status = _stream(target, prompt, 16, got)
        assert status == "OK", status
        assert got == reference(prompt, 16), f"tokens differ: {got} vs {reference(prompt, 16)}"
    elapsed = time.monotonic() - t0
    loads = {w: ray.get(h.load.remote(), timeout=30) for w, (_, h) in _workers(ray).items()}
    stats = {w: load.transfer_stats for w, load in loads.items() if load.transfer_stats is not None}
    pulled = {w: s.bytes_transferred - before.get(w, 0) for w, s in stats.items()}
    seconds = sum(s.transfer_seconds for s in stats.values())
    return {"requests": len(prompts), "seconds": round(elapsed, 2), "bytes_pulled": pulled,
            "transfer_seconds": round(seconds, 4),
            "gb_per_s": round(sum(s.bytes_transferred for s in stats.values()) / seconds / 1e9, 4)
            if seconds else None}  # fmt: skip


def _idle(ray: Any, timeout_s: float, skip: str = "") -> float:
    """Seconds until every worker but `skip` holds nothing beyond its idle baseline."""
    t0 = time.monotonic()
    busy: dict[str, str] = {}
    while time.monotonic() - t0 < timeout_s:
        busy = {}
        for w, (_, h) in _workers(ray).items():
            if w == skip:
                continue
            held = ray.get(h.load.remote(), timeout=30).held()
            if held:
                busy[w] = held
        if not busy:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise AssertionError(f"workers still hold KV or work after {timeout_s:.0f} s: {busy}")


def _migrations() -> float:
    """The router's `pdserve_migrations_total`, all kinds."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(_state()["metrics"][0], timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "pdserve_migrations" for s in f.samples
               if s.name.endswith("_total"))  # fmt: skip


def _router_workers() -> list[str]:
    from deploy.cli.cluster_client import status

    return sorted(w.worker_id for w in status(_state()["admin_targets"][0]).workers)


def step_link_fault(arg: dict[str, Any]) -> dict[str, Any]:
    from tests.references import greedy_reference

    ray = _ray()
    target = _state()["targets"][0]
    reference = greedy_reference(Path(arg["model_dir"]), stop_at_eos=False)
    prompts = _prompts(arg["model_dir"], 4, 120)
    outs: list[list[int]] = [[] for _ in prompts]
    ends: list[str] = ["" for _ in prompts]
    finished: list[float] = [0.0 for _ in prompts]

    def one(i: int) -> None:
        ends[i] = _stream(target, prompts[i], LONG_TOKENS, outs[i])
        finished[i] = time.monotonic()

    # the node goes down as soon as every stream is under way: streams of the tiny model end
    # within a second or two, so nothing is asked of the workers in between
    worker, ns = sorted(arg["decodes"].items())[0]
    arg["worker"] = worker
    migrations0 = _migrations()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(len(o) for o in outs) < 2:  # every stream under way
        assert time.monotonic() < deadline, f"streams did not start: {[len(o) for o in outs]}"
        assert all(not e for e in ends), f"a stream ended early: {ends}"
        time.sleep(0.01)
    t_down = time.monotonic()
    tokens_at_fault = [len(o) for o in outs]
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "down"],
                   check=True, timeout=30)  # fmt: skip
    gone_s = None
    while any(t.is_alive() for t in threads) or gone_s is None:
        if gone_s is None and arg["worker"] not in _router_workers():
            gone_s = time.monotonic() - t_down
        assert time.monotonic() - t_down < FAULT_DEADLINE_S, (
            f"not every stream ended within {FAULT_DEADLINE_S:.0f} s of the link going down: "
            f"{[len(o) for o in outs]} tokens, ends {ends}, worker gone after {gone_s}"
        )
        time.sleep(0.2)
    for t in threads:
        t.join()
    results = []
    for prompt, got, end, done in zip(prompts, outs, ends, finished, strict=True):
        ref = reference(prompt, LONG_TOKENS)
        if end == "OK":
            assert got == ref, "a migrated stream's tokens differ from the one-host greedy run"
        else:  # a clear status, and what it delivered is a prefix of the reference
            assert end.split(":")[0] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), end
            assert got == ref[: len(got)], "a stream delivered tokens off the reference"
        results.append({"end": end.split(":")[0], "tokens": len(got),
                        "ended_after_down_s": round(done - t_down, 2)})  # fmt: skip
    migrated = _migrations() - migrations0
    assert migrated > 0, (
        f"no stream migrated: none ran on {worker} when its link went down ({tokens_at_fault})"
    )
    idle_s = _idle(ray, 60, skip=arg["worker"])
    nodes_alive = sum(1 for n in ray.nodes() if n["Alive"])
    return {"worker": worker, "tokens_at_fault": tokens_at_fault, "migrated": migrated,
            "streams": results,
            "router_dropped_worker_s": round(gone_s, 2),
            "survivors_idle_after_s": round(idle_s, 2),
            "all_ended_s": round(max(r["ended_after_down_s"] for r in results), 2),
            "ray_nodes_alive": nodes_alive}  # fmt: skip


def step_rejoined(arg: dict[str, Any]) -> dict[str, Any]:
    from tests.references import greedy_reference

    ray = _ray()
    t0 = time.monotonic()
    while True:
        names = _node_names(ray, arg["ips"])
        decode = {w: names.get(info.node, "?") for w, (info, _) in _workers(ray).items()
                  if info.role.value == "decode"}  # fmt: skip
        if sorted(decode.values()) == ["d1", "d2"] and len(_router_workers()) == 3:
            break
        assert time.monotonic() - t0 < 300, f"no decode worker came back: {decode}"
        time.sleep(1)
    placed_s = time.monotonic() - t0
    reference = greedy_reference(Path(arg["model_dir"]), stop_at_eos=False)
    target = _state()["targets"][0]
    for prompt in _prompts(arg["model_dir"], 4, 150):
        got: list[int] = []
        assert _stream(target, prompt, 16, got) == "OK"
        assert got == reference(prompt, 16)
    return {"replacement_placed_s": round(placed_s, 1), "decode_nodes": sorted(decode.values())}


STEPS = {"placement": step_placement, "greedy": step_greedy, "link_fault": step_link_fault,
         "rejoined": step_rejoined}  # fmt: skip


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
