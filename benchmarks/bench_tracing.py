"""What tracing costs a request: TTFT through a router that traces and one that does not,
over the same workers, side by side in one run on this machine.

A 1P1D cluster (benchmarks/bench_cluster.py: tiny model, CPU, every prompt disaggregated) is
started in-script with `OTEL_TRACES_EXPORTER=pdserve_memory` (the SDK's in-memory exporter
behind its BatchSpanProcessor, default settings), so its router and both workers trace; a
second router actor over the same controller and workers runs with
`OTEL_TRACES_EXPORTER=none`, tracing off as it is by default. Its requests carry no trace
context, so the workers open no span for them either: the two routers differ by exactly what
tracing adds to a request (7 spans on the router, 3 on the workers, the context in two Ray
calls).

    on   the traced router: the caller's traceparent continued, spans exported in memory
    off  the untraced router: the same metadata sent, ignored

Each round sends one request of the same shape (a prompt of its own random token ids, so no
prefix-cache hits; greedy; ignore_eos; a traceparent in the metadata) through each router,
the order alternating from round to round, one request in flight at a time, each client on
one grpc.aio channel. TTFT is measured here from the send to the first message with tokens.

    added = p50(on) - p50(off); paired: p50 over rounds of (on - off)

    python benchmarks/bench_tracing.py [--rounds 400] [--prompt-tokens 64] [--max-tokens 4]
    python benchmarks/bench_tracing.py --aa      # neither traces: the routers' own difference
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from planner.core import percentile

VARIANTS = ("off", "on")


class Client:
    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def send(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """(TTFT, end to end) in ms."""
        req = pb.GenerateRequest(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        metadata = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)
        t0 = time.perf_counter()
        first = None
        tokens = 0
        async for msg in self.stub.Generate(req, metadata=metadata, timeout=60):
            if first is None and msg.token_ids:
                first = time.perf_counter()
            tokens += len(msg.token_ids)
        end = time.perf_counter()
        assert first is not None and tokens == max_tokens, (self.name, tokens)
        return (first - t0) * 1000, (end - t0) * 1000


async def run_rounds(
    clients: list[Client], rounds: int, args: argparse.Namespace, seed: int
) -> dict[str, list[tuple[float, float]]]:
    rng = random.Random(seed)
    samples: dict[str, list[tuple[float, float]]] = {c.name: [] for c in clients}
    for r in range(rounds):
        for client in clients if r % 2 == 0 else clients[::-1]:
            prompt = [rng.randrange(10, 500) for _ in range(args.prompt_tokens)]
            samples[client.name].append(await client.send(prompt, args.max_tokens))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400, help="measured rounds (one per router)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--aa", action="store_true", help="an A/A run: neither router traces (what the two "
        "router processes differ by without tracing)",
    )  # fmt: skip
    args = ap.parse_args()

    from bench_cluster import tiny_disaggregated

    from deploy.cluster import NAMESPACE, Cluster, loopback_env
    from deploy.controller import CONTROLLER_NAME
    from router.server import RouterActor

    loopback_env()
    # before Ray starts: every actor (the cluster also hands it to its actors)
    os.environ["OTEL_TRACES_EXPORTER"] = "none" if args.aa else "pdserve_memory"
    import ray

    config = tiny_disaggregated()
    with Cluster(config) as cluster:
        ep = cluster.endpoint
        assert ep is not None
        base = config.replica_config(0, ep.model_dir, ep.redis_url, block_hash=ep.block_hash)
        off = (
            ray.remote(RouterActor)
            .options(
                num_cpus=0,
                namespace=NAMESPACE,
                runtime_env={"env_vars": {"OTEL_TRACES_EXPORTER": "none"}},
            )
            .remote(replace(base, grpc_port=0, admin_port=0), CONTROLLER_NAME, NAMESPACE)
        )
        try:
            targets = {"on": ep.target, "off": f"127.0.0.1:{ray.get(off.start.remote()).grpc}"}

            async def run() -> dict[str, list[tuple[float, float]]]:
                clients = [Client(v, targets[v]) for v in VARIANTS]
                try:
                    await run_rounds(clients, args.warmup, args, args.seed + 999)
                    return await run_rounds(clients, args.rounds, args, args.seed)
                finally:
                    for c in clients:
                        await c.channel.close()

            samples = asyncio.run(run())
            traced = ray.get(cluster.routers[0].finished_spans.remote(), timeout=60)
            untraced = ray.get(off.finished_spans.remote(), timeout=60)
        finally:
            ray.get(off.stop.remote(), timeout=30)
            ray.kill(off)
    roots = sum(1 for s in traced if s.name == "pdserve.request")
    sent = 0 if args.aa else args.warmup + args.rounds
    assert roots == sent and not untraced, (roots, sent, len(untraced))
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; prompt "
          f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens}, {args.rounds} rounds; "
          f"{len(traced)} router spans exported ({roots} traces); ms")  # fmt: skip
    print("| router | TTFT p50 | p90 | p50 - off | paired (on - off) | e2e p50 | paired e2e |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ttft = {v: [t for t, _ in samples[v]] for v in VARIANTS}
    e2e = {v: [e for _, e in samples[v]] for v in VARIANTS}
    for v in VARIANTS:
        p50 = percentile(ttft[v], 50)
        diff = p50 - percentile(ttft["off"], 50)
        paired = percentile([a - b for a, b in zip(ttft[v], ttft["off"], strict=True)], 50)
        e2e_paired = percentile([a - b for a, b in zip(e2e[v], e2e["off"], strict=True)], 50)
        print(f"| {v} | {p50:.2f} | {percentile(ttft[v], 90):.2f} | {diff:+.2f} | "
              f"{paired:+.2f} | {percentile(e2e[v], 50):.2f} | {e2e_paired:+.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
