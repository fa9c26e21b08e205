"""Router overhead: TTFT through the gRPC API minus TTFT of the same work sent straight to the
worker actors, at a few request rates, on this machine.

A 1P1D cluster (tiny model, CPU) is started in-script with local_prefill_threshold_tokens=0,
so every gRPC request takes the disaggregated path: router → prefill actor (first token) →
decode actor (pull + stream). The direct path does the same from this process without the
router: `prefill.remote(...)` (TTFT ends when its result, which carries the first token,
arrives) and then the decode: on a token channel of this process (`--direct-path channel`,
the router's own way: one subscription, router/decode_channel.py) or on a `generate` stream
per request (`--direct-path stream`, the router's way before the channels), consumed to the
end so both paths leave the same load behind. Requests of the two paths are interleaved in
one open-loop arrival sequence (Poisson at the given rate; benchmarks/harness/ab.py), with
prompts of the same length and a cache salt of their own each (no prefix-cache hits on
either path).

    router overhead (pXX) = pXX(TTFT via gRPC) - pXX(TTFT direct)

TTFT via gRPC is measured by the client: from the call to the first streamed message (it
includes the client's and the server's gRPC stacks, validation, hashing, the Redis prefix
lookup, admission and placement). The router's own view (Timings.ttft_ms, from the request
entering the orchestrator to the first token) is reported too, which splits the overhead
into the gRPC part and the orchestrator part. The router process's CPU is reported per second
and per gRPC request (everything it did during the rate's window, polling included).

    python -m benchmarks router                          # rates 2,5,10 req/s
    python -m benchmarks router --rates 2,5,10,20 --requests 200 --markdown
    python -m benchmarks router --rates 2 --max-tokens 64  # longer decode streams
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness.ab import GenerateClient, Sample, open_loop, summarize
from benchmarks.harness.cluster import actor_pid, local_cluster
from benchmarks.harness.proc_stats import process_cpu_s
from benchmarks.harness.table import Table
from vocabulary.decode_api import DecodeRequest
from vocabulary.numeric import percentile
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole

ARMS = ("direct", "grpc")


class DirectPath:
    """The direct path (module docstring): prefill and decode actor calls from here."""

    def __init__(self, workers: list[tuple[Any, Any]], args: argparse.Namespace) -> None:
        self.prefill = next(h for i, h in workers if i.role is WorkerRole.PREFILL)
        self.decode = next(h for i, h in workers if i.role is not WorkerRole.PREFILL)
        self.sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.channel: Any = None
        if args.direct_path == "channel":
            from router.decode_channel import DecodeChannel

            self.channel = DecodeChannel("decode", self.decode, uuid.uuid4().hex[:12])

    async def send(self, round_: int, prompt: list[int]) -> Sample:
        rid, salt = uuid.uuid4().hex, uuid.uuid4().hex
        t0 = time.perf_counter()
        pre = PrefillRequest(rid, tuple(prompt), self.sampling, salt, arrival_time=time.time())
        result: PrefillResult = await self.prefill.prefill.remote(pre)
        first_at = time.perf_counter()
        tokens = 1
        dreq = DecodeRequest(
            rid, tuple(prompt), self.sampling, salt, handle=result.handle,
            first_token_id=result.first_token_id, first_logprob=result.first_logprob,
            arrival_time=time.time(),
        )  # fmt: skip
        if self.channel is None:
            async for ref in self.decode.generate.options(num_returns="streaming").remote(dreq):
                chunk = await ref
                tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    break
        else:
            stream = self.channel.open_request(rid)
            try:
                await stream.submit(dreq)
                while True:
                    chunk = await stream.next()
                    tokens += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        break
            finally:
                stream.close()
        end = time.perf_counter()
        tpot = (end - first_at) * 1000 / (tokens - 1) if tokens > 1 else 0.0
        return Sample("direct", round_, (first_at - t0) * 1000, tpot, (end - t0) * 1000, tokens)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close("benchmark done")


_ECHO_SERVER = """
import asyncio, sys, grpc
async def main():
    async def one(request, context):
        yield request
    handler = grpc.unary_stream_rpc_method_handler(one)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("echo.Echo", {"One": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


async def _timed(fn: Callable[[], Awaitable[object]], n: int = 100) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.01)
    return percentile(times, 50), percentile(times, 99)


async def floors(redis_url: str, prefill: Any) -> dict[str, tuple[float, float]]:
    """What each hop the router adds costs here, now: a gRPC server-streaming call to a
    trivial server in another process, and the Redis prefix lookup the router makes; a plain
    Ray actor call (both paths make those) for scale."""
    from prefix_index.index import PrefixIndex
    from vocabulary.block_hash import hash_chain, hash_extra

    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_stream("/echo.Echo/One", lambda b: b, lambda b: b)

            async def echo() -> None:
                async for _ in call(b"x" * 200, timeout=10):
                    break

            grpc_hop = await _timed(echo)
    finally:
        proc.kill()
    index = PrefixIndex(redis_url, "bench-floor")
    chain = hash_chain(list(range(64)), 16, hash_extra("bench-floor", ""))

    async def lookup() -> None:
        index.lookup(chain)

    redis_hop = await _timed(lookup)
    index.close()

    async def ray_call() -> None:
        await prefill.ping.remote()

    return {
        "gRPC call to a trivial server (first message)": grpc_hop,
        "Redis prefix lookup (4 blocks)": redis_hop,
        "Ray actor call (both paths)": await _timed(ray_call),
    }


def rate_row(rate: float, samples: list[Sample], cpu_s: float, window_s: float) -> list[str]:
    """One rate's line of the table (see `HEADER`)."""
    ttft = summarize(samples, ARMS, "direct")
    grpc_, direct = ttft["grpc"], ttft["direct"]
    router_view = summarize(samples, ARMS, "direct", "server_ttft_ms")["grpc"].p50
    tpot = summarize(samples, ARMS, "direct", "tpot_ms")
    return [
        f"{rate:g}", f"{grpc_.n}",
        f"{grpc_.p50:.2f} / {grpc_.p99:.2f}", f"{direct.p50:.2f} / {direct.p99:.2f}",
        f"{grpc_.minus_base_p50:.2f}", f"{grpc_.minus_base_p99:.2f}",
        f"{grpc_.p50 - router_view:.2f} / {router_view - direct.p50:.2f}",
        f"{cpu_s / window_s * 100:.1f}", f"{cpu_s / grpc_.n * 1000:.1f}",
        f"{tpot['grpc'].p50:.2f} / {tpot['direct'].p50:.2f}",
    ]  # fmt: skip


HEADER = ("rate (req/s)", "requests/path", "TTFT gRPC p50/p99 (ms)", "TTFT direct p50/p99 (ms)",
          "overhead p50 (ms)", "overhead p99 (ms)", "of p50: gRPC / orchestrator (ms)",
          "router process CPU (% of a core)", "router CPU per gRPC request (ms)",
          "TPOT p50 gRPC / direct (ms)")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="2,5,10", help="request rates (req/s), comma-separated")
    ap.add_argument("--requests", type=int, default=120, help="requests per rate (both paths)")
    ap.add_argument("--warmup", type=int, default=20, help="requests before measuring")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument(
        "--direct-path",
        choices=("channel", "stream"),
        default="channel",
        help="how the direct path reads the decode: a token channel (as the router) or a "
        "generate stream per request",
    )
    ap.add_argument("--router-pid-file", help="write the router process id here (profilers)")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    with local_cluster() as cluster:
        import ray

        endpoint = cluster.endpoint
        assert endpoint is not None
        workers = ray.get(cluster.controller.list_workers.remote())
        router_pid = actor_pid(cluster.routers[0])
        router_code = ray.get(
            cluster.routers[0].__ray_call__.remote(
                lambda _: sys.modules["router.orchestrator"].__file__
            )
        )
        if args.router_pid_file:  # e.g. for `py-spy record -p $(cat FILE)`
            Path(args.router_pid_file).write_text(str(router_pid))

        async def run() -> tuple[list[list[str]], float, dict[str, tuple[float, float]]]:
            client = GenerateClient(endpoint.target)
            direct = DirectPath(workers, args)

            async def send(arm: str, round_: int, prompt: list[int]) -> Sample:
                if arm == "direct":
                    return await direct.send(round_, prompt)
                sample = await client.send(
                    arm, round_, prompt, args.max_tokens, cache_salt=uuid.uuid4().hex
                )
                assert not sample.local_prefill
                return sample

            try:
                await open_loop(ARMS, send, args.warmup, 2.0 * len(rates), args.prompt_tokens, 999)
                cpu0, t0 = process_cpu_s(router_pid), time.perf_counter()
                await asyncio.sleep(5.0)
                idle = (process_cpu_s(router_pid) - cpu0) / (time.perf_counter() - t0)
                rows = []
                for i, rate in enumerate(rates):
                    cpu0, t0 = process_cpu_s(router_pid), time.perf_counter()
                    samples = await open_loop(
                        ARMS, send, args.requests, rate, args.prompt_tokens, args.seed + i
                    )
                    cpu_s = process_cpu_s(router_pid) - cpu0
                    rows.append(rate_row(rate, samples, cpu_s, time.perf_counter() - t0))
                return rows, idle, await floors(endpoint.redis_url, direct.prefill)
            finally:
                direct.close()
                await client.close()

        rows, idle_cpu, floor = asyncio.run(run())
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"{args.requests} requests per rate (half per path)")  # fmt: skip
    print(f"router code: {router_code}; direct path: {args.direct_path}")
    print(f"router process CPU when idle: {idle_cpu * 100:.1f}% of a core")
    print(Table.of(HEADER, rows, "l" * len(HEADER)).render(args.markdown))
    print("\nHops on this machine at the same time (p50 / p99 ms, 100 sequential calls each):")
    for name, (p50, p99) in floor.items():
        print(f"- {name}: {p50:.2f} / {p99:.2f}")
