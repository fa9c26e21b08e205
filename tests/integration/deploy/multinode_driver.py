"""The multi-node scenario's driver steps (tests/integration/deploy/multinode_scenario.py): each
runs as its own process in the head's namespace (`multinode_scenario.py --drive STEP JSON`),
so it reaches Ray, Redis and the router as a process of the head host does, and prints its
result as one `RESULT {json}` line.

    placement       where Ray put the controller, the router and each worker (by host)
    greedy          greedy requests through the router: tokens equal to the one-host reference;
                    the KV each decode worker pulled, and the hand-off rate
    stream_fault    a decode node lost mid-stream (its link down, or every process of it
                    killed): every stream completes (migrated) or ends with a clear status; the
                    router, the controller and Ray notice; nothing is left on the survivors
    rejoined        the lost node back: the replacement decode worker placed there, serving
                    (it pulls the KV of a request through the router)
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from netns_cluster import kill_namespace

TOKEN_GAP_S = 4.0  # the router's stage deadline between two chunks: migration starts past it
FAULT_DEADLINE_S = 90.0  # every stream ends within this of the fault
NOTICE_DEADLINE_S = 20.0
"""The router stops listing a lost worker within this: the controller removes it after
`failure_threshold` (3) pings missed, one a second with a 2 s timeout each (9 s), or at once
when Ray reports its actor dead; the router reads the registry every second. The rest is
slack for two cores shared with other runs."""
NODE_DEAD_DEADLINE_S = 120.0  # Ray's GCS declares a lost node dead within this
LONG_TOKENS = 200  # the reference recomputes every token: its cost grows with the square
REJOIN_BURSTS = 5  # bursts of four requests within which a replacement must serve one


def cluster_state() -> dict[str, Any]:
    return dict(json.loads(Path(os.environ["PDSERVE_STATE_FILE"]).read_text()))


Reference = Callable[[list[int], int], list[int]]
"""(prompt, max tokens) -> the one-host greedy continuation."""


def one_host_reference(model_dir: str) -> Reference:
    """transformers' float32 greedy run on one host (tests/references.py, a full recompute per
    token: its cost grows with the square), kept in a file of the run's folder so that a later
    step (another process) asking the same prompt reads it. A greedy run is a prefix of any
    longer one of the same prompt, so a shorter ask is cut from a longer one."""
    path = Path(os.environ["PDSERVE_STATE_FILE"]).parent / "greedy-reference.json"
    memo: dict[str, list[int]] = json.loads(path.read_text()) if path.exists() else {}
    compute: list[Reference] = []  # transformers loaded on the first miss only

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = ",".join(map(str, prompt))
        if len(memo.get(key, ())) < max_tokens:
            if not compute:
                from tests.references import greedy_reference

                compute.append(greedy_reference(Path(model_dir), stop_at_eos=False))
            memo[key] = compute[0](prompt, max_tokens)
            path.write_text(json.dumps(memo))
        return memo[key][:max_tokens]

    return greedy


def connect() -> Any:
    """Ray, attached to the running cluster's namespace."""
    import ray

    ray.init(address=os.environ["NETNS_RAY_ADDRESS"], namespace=cluster_state()["cluster_name"],
             log_to_driver=False)  # fmt: skip
    return ray


def router_target() -> str:
    return str(cluster_state()["targets"][0])


def workers(ray: Any) -> dict[str, tuple[Any, Any]]:
    """The controller's workers: id -> (WorkerInfo, actor handle)."""
    from deploy.control.cluster_controller import CONTROLLER_NAME

    controller = ray.get_actor(CONTROLLER_NAME)
    return {info.worker_id: (info, h) for info, h in ray.get(controller.list_workers.remote(),
                                                             timeout=30)}  # fmt: skip


def _node_names(ray: Any, ips: dict[str, str]) -> dict[str, str]:
    """Ray node id -> our host name (by the node's address)."""
    return {n["NodeID"]: ips.get(n["NodeManagerAddress"], "?") for n in ray.nodes()}


def step_placement(ips: dict[str, str]) -> dict[str, Any]:
    ray = connect()
    from ray._private import state  # the GCS's actor table (the state API needs a dashboard)

    names = _node_names(ray, ips)
    actors = {a["Name"]: names.get(a["Address"]["NodeID"], "?")
              for a in state.actors(actor_state_name="ALIVE").values() if a["Name"]}  # fmt: skip
    return {
        "controller": actors.get("pdserve-controller", "?"),
        "routers": sorted(n for name, n in actors.items() if name.startswith("pdserve-router")),
        "workers": {w: names.get(info.node, "?") for w, (info, _) in workers(ray).items()},
    }


def prompts(model_dir: str, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens of the bundled corpus, the i-th from token 97 * i."""
    from deploy.checkpoints.checkpoint_files import CORPUS
    from vocabulary.tokenizer import Tokenizer

    ids = Tokenizer.from_model_dir(Path(model_dir)).encode(CORPUS.read_text())
    return [ids[i * 97 : i * 97 + length] for i in range(n)]


def stream(target: str, prompt: list[int], max_tokens: int, got: list[int], salt: str = "",
           timeout_s: float = FAULT_DEADLINE_S + 60) -> str:  # fmt: skip
    """Stream one greedy request into `got`; its end as a status name (OK or the gRPC code).
    A `salt` of its own keeps placement from favouring a worker that cached the prompt."""
    import grpc

    from deploy.cli.cluster_client import stream_generate
    from pdserve.v1 import serving_pb2 as pb

    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                 ignore_eos=True, cache_salt=salt)  # fmt: skip
    try:
        for msg in stream_generate(target, request, timeout_s=timeout_s):
            got.extend(msg.token_ids)
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def check_end(end: str, got: list[int], ref: list[int]) -> None:
    """A stream that ended OK delivered the reference; one that did not ended with a clear
    status, and what it delivered is a prefix of the reference."""
    if end == "OK":
        assert got == ref, "a stream's tokens differ from the one-host greedy run"
    else:
        assert end.split(":")[0] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), end
        assert got == ref[: len(got)], "a stream delivered tokens off the reference"


def _pulled(ray: Any) -> dict[str, int]:
    loads = {w: ray.get(h.load.remote(), timeout=30) for w, (_, h) in workers(ray).items()}
    return {w: load.transfer_stats.bytes_transferred for w, load in loads.items()
            if load.transfer_stats is not None}  # fmt: skip


def step_greedy(arg: dict[str, Any]) -> dict[str, Any]:
    ray = connect()
    target = router_target()
    reference = one_host_reference(arg["model_dir"])
    before = _pulled(ray)
    t0 = time.monotonic()
    for prompt in prompts(arg["model_dir"], 6, 200):
        got: list[int] = []
        status = stream(target, prompt, 16, got)
        assert status == "OK", status
        assert got == reference(prompt, 16), f"tokens differ: {got} vs {reference(prompt, 16)}"
    elapsed = time.monotonic() - t0
    loads = {w: ray.get(h.load.remote(), timeout=30) for w, (_, h) in workers(ray).items()}
    stats = {w: load.transfer_stats for w, load in loads.items() if load.transfer_stats is not None}
    pulled = {w: s.bytes_transferred - before.get(w, 0) for w, s in stats.items()}
    seconds = sum(s.transfer_seconds for s in stats.values())
    return {"requests": 6, "seconds": round(elapsed, 2), "bytes_pulled": pulled,
            "transfer_seconds": round(seconds, 4),
            "gb_per_s": round(sum(s.bytes_transferred for s in stats.values()) / seconds / 1e9, 4)
            if seconds else None}  # fmt: skip


def idle_within(ray: Any, timeout_s: float, skip: str = "") -> float:
    """Seconds until every worker but `skip` holds nothing beyond its idle baseline."""
    t0 = time.monotonic()
    busy: dict[str, str] = {}
    while time.monotonic() - t0 < timeout_s:
        busy = {}
        for w, (_, h) in workers(ray).items():
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

    with urllib.request.urlopen(cluster_state()["metrics"][0], timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "pdserve_migrations" for s in f.samples
               if s.name.endswith("_total"))  # fmt: skip


def router_workers() -> list[str]:
    from deploy.cli.cluster_client import status

    return sorted(w.worker_id for w in status(cluster_state()["admin_targets"][0]).workers)


def _take_down(fault: str, ns: str) -> int:
    """The fault on the node of namespace `ns`: `link_down` takes its interface down;
    `node_killed` SIGKILLs every process of it (its raylet, Ray's daemons and every worker
    process), as a host whose processes the OOM killer or an operator took; how many died."""
    if fault == "link_down":
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "down"],
                       check=True, timeout=30)  # fmt: skip
        return 0
    assert fault == "node_killed", fault
    return kill_namespace(ns)


def step_stream_fault(arg: dict[str, Any]) -> dict[str, Any]:
    """Four long streams (cache salt `arg["salt"]`); `arg["fault"]` on the node of decode
    worker `arg["worker"]` (namespace `arg["ns"]`) as soon as all four are under way."""
    ray = connect()
    target = router_target()
    reference = one_host_reference(arg["model_dir"])
    asked = prompts(arg["model_dir"], 4, 120)
    outs: list[list[int]] = [[] for _ in asked]
    ends: list[str] = ["" for _ in asked]
    finished: list[float] = [0.0 for _ in asked]

    def one(i: int) -> None:
        ends[i] = stream(target, asked[i], LONG_TOKENS, outs[i], arg["salt"])
        finished[i] = time.monotonic()

    worker, fault = arg["worker"], arg["fault"]
    node_id = workers(ray)[worker][0].node
    migrations0 = _migrations()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    # the fault comes as soon as every stream is under way: streams of the tiny model end
    # within a second or two, so nothing is asked of the workers in between
    deadline = time.monotonic() + 120
    while min(len(o) for o in outs) < 2:
        assert time.monotonic() < deadline, f"streams did not start: {[len(o) for o in outs]}"
        assert all(not e for e in ends), f"a stream ended early: {ends}"
        time.sleep(0.01)
    t_fault = time.monotonic()
    tokens_at_fault = [len(o) for o in outs]
    killed = _take_down(fault, arg["ns"])
    gone_s = dead_s = None
    # the reference is computed while Ray's GCS takes its time, once nothing else is timed
    checker = threading.Thread(target=lambda: [reference(p, LONG_TOKENS) for p in asked])
    while (streaming := any(t.is_alive() for t in threads)) or gone_s is None or dead_s is None:
        since = time.monotonic() - t_fault
        if gone_s is None and worker not in router_workers():
            gone_s = since
        if not streaming and gone_s is not None and checker.ident is None:
            checker.start()
        if dead_s is None and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id):
            dead_s = since
        assert not streaming or since < FAULT_DEADLINE_S, (
            f"not every stream ended within {FAULT_DEADLINE_S:.0f} s of the fault: "
            f"{[len(o) for o in outs]} tokens, ends {ends}"
        )  # fmt: skip
        assert gone_s is not None or since < NOTICE_DEADLINE_S, (
            f"the router still lists {worker} {NOTICE_DEADLINE_S:.0f} s after the fault"
        )
        assert dead_s is not None or since < NODE_DEAD_DEADLINE_S, (
            f"Ray's GCS still holds the node alive {NODE_DEAD_DEADLINE_S:.0f} s after the fault"
        )
        time.sleep(0.2)
    for t in (*threads, checker):
        if t.ident is None:
            t.start()
        t.join()
    results = []
    for prompt, got, end, done in zip(asked, outs, ends, finished, strict=True):
        check_end(end, got, reference(prompt, LONG_TOKENS))
        results.append({"end": end.split(":")[0], "tokens": len(got),
                        "ended_after_fault_s": round(done - t_fault, 2)})  # fmt: skip
    migrated = _migrations() - migrations0
    assert migrated > 0, (
        f"no stream migrated: none ran on {worker} at the fault ({tokens_at_fault})"
    )
    idle_s = idle_within(ray, 60, skip=worker)
    return {"worker": worker, "fault": fault, "processes_killed": killed,
            "tokens_at_fault": tokens_at_fault, "migrated": migrated, "streams": results,
            "all_ended_s": round(max(finished) - t_fault, 2),
            "router_dropped_worker_s": round(gone_s, 2),
            "ray_node_dead_s": round(dead_s, 2),
            "survivors_idle_after_s": round(idle_s, 2),
            "ray_nodes_alive": sum(1 for n in ray.nodes() if n["Alive"])}  # fmt: skip


def _greedy_burst(model_dir: str, salt: str) -> None:
    """Four greedy requests through the router at once (cache salt `salt`), each ending OK
    within FAULT_DEADLINE_S with the one-host run's tokens."""
    reference = one_host_reference(model_dir)
    asked = prompts(model_dir, 4, 150)
    outs: list[list[int]] = [[] for _ in asked]
    ends = ["" for _ in asked]

    def one(i: int) -> None:
        ends[i] = stream(router_target(), asked[i], 16, outs[i], salt)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=FAULT_DEADLINE_S)
        assert not t.is_alive(), f"a request did not end within {FAULT_DEADLINE_S:.0f} s"
    for prompt, got, end in zip(asked, outs, ends, strict=True):
        assert end == "OK", end
        assert got == reference(prompt, 16), "tokens differ from the one-host greedy run"


def step_rejoined(arg: dict[str, Any]) -> dict[str, Any]:
    """The replacement decode worker placed on the lost node (`arg["node"]`) again, and
    serving: bursts of four greedy requests through the router until it has pulled the KV of
    one (placement goes by load, and a worker the router has just taken in may not have had
    its load read yet, so the first burst can pass it by)."""
    ray = connect()
    t0 = time.monotonic()
    while True:
        names = _node_names(ray, arg["ips"])
        decode = {w: names.get(info.node, "?") for w, (info, _) in workers(ray).items()
                  if info.role.value == "decode"}  # fmt: skip
        if sorted(decode.values()) == ["d1", "d2"] and len(router_workers()) == 3:
            break
        assert time.monotonic() - t0 < 300, f"no decode worker came back: {decode}"
        time.sleep(1)
    placed_s = time.monotonic() - t0
    before = _pulled(ray)
    pulled: dict[str, int] = {}
    for burst in range(1, REJOIN_BURSTS + 1):
        _greedy_burst(arg["model_dir"], f"{arg['salt']}-{burst}")  # a salt each: no reuse
        pulled = {decode[w]: n - before.get(w, 0) for w, n in _pulled(ray).items()
                  if w in decode}  # fmt: skip
        if pulled.get(arg["node"], 0) > 0:
            break
    assert pulled.get(arg["node"], 0) > 0, (
        f"the replacement on {arg['node']} served nothing in {REJOIN_BURSTS} bursts: {pulled}"
    )
    return {"replacement_placed_s": round(placed_s, 1), "decode_nodes": sorted(decode.values()),
            "serving_s": round(time.monotonic() - t0, 1), "bursts": burst,
            "pulled_by_node": pulled}  # fmt: skip


STEPS = {"placement": step_placement, "greedy": step_greedy, "stream_fault": step_stream_fault,
         "rejoined": step_rejoined}  # fmt: skip
