"""What tracing costs a request: TTFT through one router with tracing on and paused, side by
side in one run on this machine.

A 1P1D cluster (benchmarks/harness/cluster.py: tiny model, CPU, every prompt disaggregated) is
started in-script with `OTEL_TRACES_EXPORTER=pdserve_memory` (the SDK's in-memory exporter behind
its BatchSpanProcessor, default settings), so its router and both workers trace. Each round sends
two requests of the same shape (a prompt of its own random token ids, so no prefix-cache hits;
greedy; ignore_eos; a traceparent in the metadata) through that router, one with its tracing on and
one with it paused (`RouterActor.pause_tracing`, called between requests, outside the timed
window), the order alternating from round to round (benchmarks/harness/ab.py), one request in
flight at a time, on one grpc.aio channel. Paused, the router opens no span and sends no context,
so the workers open none either: the two requests differ by exactly what tracing adds (7 spans on
the router, 3 on the workers, the context in two Ray calls). TTFT is measured here from the send to
the first message with tokens. After each request the client waits `--gap-ms` (20): a traced
request's spans are made in the SDK 5 ms after it ends, on the router and both workers (~0.1 ms of
CPU on the router, measured in-process), which is tracing's cost in throughput, not in the traced
request's TTFT; without the gap it would fall on whichever request came next.

One router for both: two router actors differ from each other by more than tracing costs (an
A/A run over two routers, neither tracing, put them +0.85 ms p50 apart on a 2-core machine).

    added = p50(on) - p50(off); paired: p50 over rounds of (on - off)

The paired p50's standard error is about 0.05 ms at 1,500 rounds on a 2-core machine; 6,000
rounds (about 10 minutes) resolve the 0.1 ms goal there (docs/benchmarks.md).

    python -m benchmarks tracing [--rounds 400] [--prompt-tokens 64] [--max-tokens 4]
    python -m benchmarks tracing --aa      # paused for both: the method's own spread
    python -m benchmarks tracing --workers-untraced  # the router's part alone

`--workers-untraced` pauses the workers' tracing for the whole run (the router still sends the
context, which they then ignore): "on" then costs only what the router adds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from collections.abc import Sequence
from typing import Any

from benchmarks.harness.ab import GenerateClient, Sample, closed_rounds, summarize
from benchmarks.harness.cluster import local_cluster
from benchmarks.harness.table import Table

VARIANTS = ("off", "on")


def traceparent() -> tuple[tuple[str, str], ...]:
    """A fresh W3C trace context (a sampled trace of its own) for one request."""
    return (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)


def pause_workers_tracing(cluster: Any) -> None:
    """Pause tracing in every worker actor of the cluster (it opens no span for any request)."""
    import ray

    def pause(_actor: Any) -> bool:  # nested: it travels by value, wherever benchmarks is
        from vocabulary.tracing import pause_tracing

        return pause_tracing(True)

    workers = ray.get(cluster.controller.list_workers.remote(), timeout=30)
    assert workers
    for _info, actor in workers:
        assert ray.get(actor.__ray_call__.remote(pause), timeout=30) is False


def table(samples: list[Sample]) -> Table:
    ttft = summarize(samples, VARIANTS, "off")
    e2e = summarize(samples, VARIANTS, "off", "e2e_ms")
    header = ("tracing", "TTFT p50", "p90", "p50 - off", "paired (on - off)", "e2e p50",
              "paired e2e")  # fmt: skip
    rows = [
        (v, f"{s.p50:.2f}", f"{s.p90:.2f}", f"{s.minus_base_p50:+.2f}", f"{s.paired_p50:+.2f}",
         f"{e2e[v].p50:.2f}", f"{e2e[v].paired_p50:+.2f}")
        for v, s in ttft.items()
    ]  # fmt: skip
    return Table.of(header, rows)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
    args = ap.parse_args(argv)

    # every actor traces (the cluster hands the variable to its actors too)
    with local_cluster(env={"OTEL_TRACES_EXPORTER": "pdserve_memory"}) as cluster:
        import ray

        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        router = cluster.routers[0]
        if args.workers_untraced:
            pause_workers_tracing(cluster)

        async def run() -> list[Sample]:
            client = GenerateClient(target, metadata=traceparent)

            async def set_tracing(variant: str) -> None:
                """The router's tracing for the variant (paused for both in an A/A run)."""
                traced = await router.pause_tracing.remote(args.aa or variant == "off")
                assert traced == (variant == "on" and not args.aa), (variant, traced)

            async def send(variant: str, round_: int, prompt: list[int]) -> Sample:
                return await client.send(variant, round_, prompt, args.max_tokens)

            async def rounds(n: int, seed: int, first: int = 0) -> list[Sample]:
                gap_s = args.gap_ms / 1000  # after each request: its spans are made now
                return await closed_rounds(
                    VARIANTS, send, n, args.prompt_tokens, seed, first, before=set_tracing,
                    gap_s=gap_s,
                )  # fmt: skip

            try:
                await rounds(args.warmup, args.seed + 999, first=-args.warmup)
                return await rounds(args.rounds, args.seed)
            finally:
                await client.close()

        samples = asyncio.run(run())
        traced = ray.get(router.finished_spans.remote(), timeout=60)
    roots = sum(1 for s in traced if s.name == "pdserve.request")
    sent = 0 if args.aa else args.warmup + args.rounds
    assert roots == sent, (roots, sent)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; prompt "
          f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens}, {args.rounds} rounds; "
          f"{len(traced)} router spans exported ({roots} traces); ms")  # fmt: skip
    print(table(samples).markdown())
