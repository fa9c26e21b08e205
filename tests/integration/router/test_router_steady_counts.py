"""The short guard of issue 50's soak: what a worker process holds comes back once its requests
are over. Two identical mixed bursts on both routers (streams read to the end, cancelled mid
way, cut by deadlines; structured output, top logprobs), each followed by the idle wait: after
the second, no worker holds more asyncio tasks or Python threads than after the first, nor
more than 2 more open file descriptors (a count that grows per burst is a leak;
the first burst fills the pools a worker keeps). The slopes a long soak resolves are
benchmarks/suites/soak.py's."""

from __future__ import annotations

import json
import random
import threading
import time

import grpc
from router_harness import RouterCluster

from pdserve.v1 import serving_pb2 as pb
from vocabulary.worker_api import ProcessCounts

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _burst(rc: RouterCluster, corpus_ids: list[int]) -> None:
    rng = random.Random(11)  # the same burst every time

    def one(i: int) -> None:
        prompt = corpus_ids[rng.randrange(0, 1500) :][: rng.randrange(10, 150)]
        fields: dict[str, object] = dict(token_ids=prompt, max_tokens=24, temperature=1.0,
                                         seed=i)  # fmt: skip
        if i % 4 == 1:
            fields["structured_output"] = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
        if i % 4 == 2:
            fields |= {"logprobs": True, "top_logprobs": 3}
        timeout = 0.05 + 0.02 * (i % 5) if i % 5 == 3 else 60.0
        call = rc.generation(i % 2).Generate(pb.GenerateRequest(**fields), timeout=timeout)  # type: ignore[arg-type]
        try:
            for n, _ in enumerate(call):
                if i % 5 == 4 and n == 2:
                    call.cancel()
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED), e.details()  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def _settled_counts(rc: RouterCluster) -> dict[str, ProcessCounts]:
    """Each worker's counts once idle and unchanged over a second (tasks that end on their
    own, such as deferred span flushes, have ended), within 20 s."""
    end = time.monotonic() + 20
    last = {w: load.process for w, load in rc.wait_idle().items()}
    while time.monotonic() < end:
        time.sleep(1.0)
        now = {w: load.process for w, load in rc.wait_idle().items()}
        if now == last:
            break
        last = now
    return last


def test_two_identical_bursts_leave_each_worker_with_the_same_counts(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    router_cluster.wait_idle()
    _burst(router_cluster, corpus_ids)
    first = _settled_counts(router_cluster)
    assert all(c.fds > 0 and c.threads > 0 and c.tasks > 0 for c in first.values()), first
    _burst(router_cluster, corpus_ids)
    second = _settled_counts(router_cluster)
    grew = {
        w: (str(first[w]), str(second[w]))
        for w in first
        if second[w].tasks > first[w].tasks
        or second[w].threads > first[w].threads
        or second[w].fds > first[w].fds + 2
    }
    assert not grew, grew
