"""The multi-node scenario's hand-off figure (tests/integration/deploy/multinode_scenario.py):
the same KV payloads pulled from the prefill worker on `p1` by a decode worker on another node
(across the veth) and by a probe decode worker on `p1` itself (within one namespace: UCX's TCP
over the node's loopback), one after the other for each payload; run again while the scenario
slows `p1`'s link (a qdisc on its interface), with greedy requests through the router meanwhile.
A driver step (multinode_driver.py says how steps run).

    handoff    arg: model_dir; config (the cluster's config file); prefill_ns, prefill_ip (the
               prefill node's namespace and address); across (a decode worker on another
               node); label; router_requests (greedy requests through the router after the
               pulls, each with a deadline; 0: none); keep_probe (leave the probe for the next
               run of the step; else it is killed at the end)

Each pull is one request driven worker to worker as the router drives it (prefill, then the
decode worker pulls the handle's blocks and decodes): its bytes and seconds are the decode
worker's `TransferStats` before and after it (from the read's start to its completion), and
the prefill node's interface counter says whether the bytes left the node. A fresh cache salt
per pull keeps both workers from reusing a block, so every pull moves the whole payload.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from multinode_driver import (
    Reference,
    check_end,
    cluster_state,
    connect,
    one_host_reference,
    prompts,
    router_target,
    stream,
    workers,
)

PROBE_ID = "handoff-probe"
PAYLOADS = 6  # those of the greedy step: 6 prompts of 200 tokens
PROMPT_TOKENS = 200
ROUNDS = 3  # each payload pulled this many times each way
CHECK_TOKENS = 4  # tokens decoded after each pull, checked against the one-host reference
REQUEST_DEADLINE_S = 60.0  # each greedy request through the router under the slow link
PROBE_START_S = 300.0


@dataclass(frozen=True)
class Pull:
    """One hand-off: payload bytes, the decode worker's transfer seconds, and the bytes the
    prefill node's interface sent meanwhile."""

    nbytes: int
    seconds: float
    link_tx_bytes: int


def link_tx_bytes(ns: str) -> int:
    """Bytes the interface of namespace `ns` has sent (its own /sys)."""
    counter = "/sys/class/net/eth0/statistics/tx_bytes"
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", counter], capture_output=True,
                         text=True, timeout=10, check=True)  # fmt: skip
    return int(out.stdout)


def _probe(ray: Any, arg: dict[str, Any]) -> Any:
    """The probe decode worker on the prefill's node, made on first use (detached, so the
    next run of the step finds it): the cluster's decode engine and transfer settings, read
    from its config file as `pdserve up` reads them; no prefix index (the router never sees
    it: it is not the controller's)."""
    from deploy.cli.options import config_input, effective_config, load_config
    from deploy.control.worker_actors import create_worker
    from vocabulary.worker_api import ActorPlacement, WorkerRole, actor_name_for
    from worker_runtime.runtime import WorkerConfig

    namespace = cluster_state()["cluster_name"]
    try:
        return ray.get_actor(actor_name_for(PROBE_ID), namespace=namespace)
    except ValueError:
        pass  # not made yet
    spec = effective_config(config_input(load_config(Path(arg["config"])), {})).workers
    engine = replace(spec.engine_for(WorkerRole.DECODE), model_dir=arg["model_dir"])
    config = WorkerConfig(PROBE_ID, WorkerRole.DECODE, engine, namespace=namespace,
                          torch_threads=spec.torch_threads)  # fmt: skip
    # Ray's own `node:<address>` resource pins it to the prefill's node
    on_node = ActorPlacement(num_cpus=0, resources=((f"node:{arg['prefill_ip']}", 0.001),))
    handle = create_worker(config, spec.transfer, on_node, detached=True)
    ray.get(handle.start.remote(), timeout=PROBE_START_S)
    return handle


async def _pull(prefill: Any, decode: Any, rid: str, prompt: list[int], ns: str,
                reference: list[int]) -> Pull:  # fmt: skip
    from tests.integration.workers.pd_client import serve
    from vocabulary.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    before = (await decode.load.remote()).transfer_stats
    tx0 = link_tx_bytes(ns)
    served = await serve(prefill, decode, rid, prompt, greedy, cache_salt=rid)
    tx = link_tx_bytes(ns) - tx0
    after = (await decode.load.remote()).transfer_stats
    assert served.token_ids == reference, f"{rid}: tokens differ from the one-host greedy run"
    assert after.blocks_reused == before.blocks_reused, f"{rid} reused a block: not a full pull"
    nbytes = after.bytes_transferred - before.bytes_transferred
    assert nbytes > 0, f"{rid}: nothing was pulled"
    return Pull(nbytes, after.transfer_seconds - before.transfer_seconds, tx)


def _summary(pulls: list[Pull]) -> dict[str, Any]:
    nbytes = sum(p.nbytes for p in pulls)
    seconds = sum(p.seconds for p in pulls)
    return {"pulls": len(pulls), "bytes": nbytes, "bytes_each": sorted({p.nbytes for p in pulls}),
            "transfer_s": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 4),
            "ms_p50": round(statistics.median(p.seconds for p in pulls) * 1e3, 1),
            "ms_max": round(max(p.seconds for p in pulls) * 1e3, 1),
            "link_tx_bytes": sum(p.link_tx_bytes for p in pulls)}  # fmt: skip


def _router_requests(arg: dict[str, Any], reference: Reference) -> list[dict[str, Any]]:
    """Greedy requests through the router, all at once, each with a gRPC deadline: each
    completes equal to the reference or ends with a clear status within its deadline."""
    asked = prompts(arg["model_dir"], arg["router_requests"], 150)
    outs: list[list[int]] = [[] for _ in asked]
    ends = ["" for _ in asked]
    took = [0.0 for _ in asked]

    def one(i: int) -> None:
        t0 = time.monotonic()
        salt = f"router-{arg['label']}"  # a salt of their own: every one pulls its KV
        ends[i] = stream(router_target(), asked[i], 16, outs[i], salt, REQUEST_DEADLINE_S)
        took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_DEADLINE_S + 10)
        assert not t.is_alive(), f"a request outlived its {REQUEST_DEADLINE_S:.0f} s deadline"
    for prompt, got, end in zip(asked, outs, ends, strict=True):
        check_end(end, got, reference(prompt, 16))
    return [{"end": e.split(":")[0], "tokens": len(o), "seconds": round(s, 2)}
            for e, o, s in zip(ends, outs, took, strict=True)]  # fmt: skip


def step_handoff(arg: dict[str, Any]) -> dict[str, Any]:
    ray = connect()
    by_id = workers(ray)
    prefill = next(h for info, h in by_id.values() if info.role.value == "prefill")
    across = by_id[arg["across"]][1]
    t0 = time.monotonic()
    probe = _probe(ray, arg)
    probe_s = time.monotonic() - t0
    reference = one_host_reference(arg["model_dir"])
    ns, label = arg["prefill_ns"], arg["label"]
    paths = {"veth": across, "namespace": probe}
    pulls: dict[str, list[Pull]] = {path: [] for path in paths}

    async def pull_all() -> None:
        for r in range(ROUNDS):
            for i, prompt in enumerate(prompts(arg["model_dir"], PAYLOADS, PROMPT_TOKENS)):
                ref = reference(prompt, CHECK_TOKENS)
                for path, decode in paths.items():  # the same payload each way, in turn
                    rid = f"handoff-{label}-{path}-{r}-{i}"
                    pulls[path].append(await _pull(prefill, decode, rid, prompt, ns, ref))

    asyncio.run(pull_all())
    for p in pulls["veth"]:  # the KV left the prefill's node: it crossed the veth
        assert p.link_tx_bytes >= p.nbytes, f"a pull across sent {p} on the link: too little"
    for p in pulls["namespace"]:  # it stayed on the node: its loopback, not its link
        assert p.link_tx_bytes < p.nbytes / 2, f"a pull within one namespace crossed the link: {p}"
    result: dict[str, Any] = {path: _summary(ps) for path, ps in pulls.items()}
    veth, here = result["veth"], result["namespace"]
    result["veth_over_namespace"] = {
        "time_p50": round(veth["ms_p50"] / here["ms_p50"], 2),
        "time_total": round(veth["transfer_s"] / here["transfer_s"], 2),
    }
    result["probe_start_s"] = round(probe_s, 1)
    if arg["router_requests"]:
        result["router_requests"] = _router_requests(arg, reference)
    if not arg["keep_probe"]:
        ray.kill(probe)
    return result


STEPS = {"handoff": step_handoff}
