"""What tracing costs a request: TTFT through one router with tracing on and paused, side by
side in one run on this machine.

A 1P1D cluster (benchmarks/bench_cluster.py: tiny model, CPU, every prompt disaggregated) is
started in-script with `OTEL_TRACES_EXPORTER=pdserve_memory` (the SDK's in-memory exporter
behind its BatchSpanProcessor, default settings), so its router and both workers trace. Each
round sends two requests of the same shape (a prompt of its own random token ids, so no
prefix-cache hits; greedy; ignore_eos; a traceparent in the metadata) through that router,
one with its tracing on and one with it paused (`RouterActor.pause_tracing`, called between
requests, outside the timed window), the order alternating from round to round, one request
in flight at a time, on one grpc.aio channel. Paused, the router opens no span and sends no
context, so the workers open none either: the two requests differ by exactly what tracing
adds (7 spans on the router, 3 on the workers, the context in two Ray calls). TTFT is
measured here from the send to the first message with tokens. After each request the client
waits `--gap-ms` (20): a traced request's spans are made in the SDK 5 ms after it ends, on the
router and both workers (~0.1 ms of CPU on the router, measured in-process), which is
tracing's cost in throughput, not in the traced request's TTFT; without the gap it would fall
on whichever request came next.

One router for both: an earlier version compared a traced router with a second, untraced
router actor, and its A/A run (neither tracing) showed the two routers themselves differing
by +0.85 ms p50 on this 2-core machine, more than tracing costs.

    added = p50(on) - p50(off); paired: p50 over rounds of (on - off)

The paired p50's standard error is about 0.05 ms at 1,500 rounds on a 2-core machine; 6,000
rounds (about 10 minutes) resolve the 0.1 ms goal there (docs/benchmarks.md).

    python benchmarks/bench_tracing.py [--rounds 400] [--prompt-tokens 64] [--max-tokens 4]
    python benchmarks/bench_tracing.py --aa      # paused for both: the method's own spread
    python benchmarks/bench_tracing.py --workers-untraced  # the router's part alone

`--workers-untraced` pauses the workers' tracing for the whole run (the router still sends the
context, which they then ignore): "on" then costs only what the router adds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.numeric import percentile

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
    client: Client, router: Any, rounds: int, args: argparse.Namespace, seed: int
) -> dict[str, list[tuple[float, float]]]:
    """`rounds` rounds of one request per variant, the order alternating; before each, the
    router's tracing is set for the variant (paused for both in an A/A run)."""
    rng = random.Random(seed)
    samples: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            traced = await router.pause_tracing.remote(args.aa or variant == "off")
            assert traced == (variant == "on" and not args.aa), (variant, traced)
            prompt = [rng.randrange(10, 500) for _ in range(args.prompt_tokens)]
            samples[variant].append(await client.send(prompt, args.max_tokens))
            await asyncio.sleep(args.gap_ms / 1000)  # a traced request's spans are made now
    return samples


def _pause_here() -> bool:
    from vocabulary.tracing import pause_tracing

    return pause_tracing(True)


def pause_workers_tracing(cluster: Any) -> None:
    """Pause tracing in every worker actor of the cluster (it opens no span for any request)."""
    import ray

    workers = ray.get(cluster.controller.list_workers.remote(), timeout=30)
    assert workers
    for _info, actor in workers:
        assert ray.get(actor.__ray_call__.remote(lambda _self: _pause_here()), timeout=30) is False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds", type=int, default=400, help="measured rounds (each: one request a variant)"
    )
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gap-ms", type=float, default=20.0, help="pause after each request: a traced "
        "request's spans are made in the SDK 5 ms after it ends (router and workers), "
        "so without a gap that work lands on the next request, whichever variant it is",
    )  # fmt: skip
    ap.add_argument(
        "--aa", action="store_true", help="an A/A run: tracing paused for both variants (the "
        "method's own spread)",
    )  # fmt: skip
    ap.add_argument(
        "--workers-untraced", action="store_true", help="the workers' tracing paused for the "
        "whole run: what the router alone adds",
    )  # fmt: skip
    args = ap.parse_args()

    from bench_cluster import tiny_disaggregated

    from deploy.control.launch import Cluster, loopback_env

    loopback_env()
    # before Ray starts: every actor (the cluster also hands it to its actors)
    os.environ["OTEL_TRACES_EXPORTER"] = "pdserve_memory"
    import ray

    config = tiny_disaggregated()
    with Cluster(config) as cluster:
        ep = cluster.endpoint
        assert ep is not None
        router = cluster.routers[0]
        if args.workers_untraced:
            pause_workers_tracing(cluster)

        async def run() -> dict[str, list[tuple[float, float]]]:
            client = Client("router", ep.target)
            try:
                await run_rounds(client, router, args.warmup, args, args.seed + 999)
                return await run_rounds(client, router, args.rounds, args, args.seed)
            finally:
                await client.channel.close()

        samples = asyncio.run(run())
        traced = ray.get(router.finished_spans.remote(), timeout=60)
    roots = sum(1 for s in traced if s.name == "pdserve.request")
    sent = 0 if args.aa else args.warmup + args.rounds
    assert roots == sent, (roots, sent)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; prompt "
          f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens}, {args.rounds} rounds; "
          f"{len(traced)} router spans exported ({roots} traces); ms")  # fmt: skip
    print("| tracing | TTFT p50 | p90 | p50 - off | paired (on - off) | e2e p50 | paired e2e |")
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
