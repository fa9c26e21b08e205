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
one open-loop arrival sequence (Poisson at the given rate), with prompts of the same length
and a cache salt of their own each (no prefix-cache hits on either path).

    router overhead (pXX) = pXX(TTFT via gRPC) - pXX(TTFT direct)

TTFT via gRPC is measured by the client: from the call to the first streamed message (it
includes the client's and the server's gRPC stacks, validation, hashing, the Redis prefix
lookup, admission and placement). The router's own view (Timings.ttft_ms, from the request
entering the orchestrator to the first token) is reported too, which splits the overhead
into the gRPC part and the orchestrator part. The router process's CPU is reported per second
and per gRPC request (everything it did during the rate's window, polling included).

    python benchmarks/bench_router.py                          # rates 2,5,10 req/s
    python benchmarks/bench_router.py --rates 2,5,10,20 --requests 200 --markdown
    python benchmarks/bench_router.py --rates 2 --max-tokens 64  # longer decode streams
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.decode_api import DecodeRequest
from vocabulary.numeric import percentile
from vocabulary.prefill_api import PrefillRequest, PrefillResult
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole


@dataclass(frozen=True)
class Sample:
    path: str  # "grpc" or "direct"
    ttft_ms: float
    router_ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    """First token to last, per token after the first, as this process saw them."""


def tpot_ms(first_at: float, last_at: float, tokens: int) -> float:
    return (last_at - first_at) * 1000 / (tokens - 1) if tokens > 1 else 0.0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, target: str, workers: list[tuple[Any, Any]], args: argparse.Namespace):
        self.args = args
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.prefill = next(h for i, h in workers if i.role is WorkerRole.PREFILL)
        self.decode = next(h for i, h in workers if i.role is not WorkerRole.PREFILL)
        self.sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.decode_channel: Any = None
        if args.direct_path == "channel":
            from router.decode_channel import DecodeChannel

            self.decode_channel = DecodeChannel("decode", self.decode, uuid.uuid4().hex[:12])

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(2, 500) for _ in range(self.args.prompt_tokens)]

    async def via_grpc(self, prompt: list[int]) -> Sample:
        req = pb.GenerateRequest(
            token_ids=prompt, max_tokens=self.args.max_tokens, temperature=0.0,
            ignore_eos=True, cache_salt=uuid.uuid4().hex,
        )  # fmt: skip
        t0 = time.perf_counter()
        ttft = None
        tokens = 0
        async for msg in self.stub.Generate(req, timeout=60):
            now = time.perf_counter()
            if ttft is None:
                ttft, first_at = (now - t0) * 1000, now
            tokens += len(msg.token_ids)
            last, last_at = msg, now
        assert ttft is not None and last.finish_reason
        assert not last.timings.local_prefill
        return Sample("grpc", ttft, last.timings.ttft_ms, tpot_ms(first_at, last_at, tokens))

    async def direct(self, prompt: list[int]) -> Sample:
        rid, salt = uuid.uuid4().hex, uuid.uuid4().hex
        t0 = time.perf_counter()
        pre = PrefillRequest(rid, tuple(prompt), self.sampling, salt, arrival_time=time.time())
        result: PrefillResult = await self.prefill.prefill.remote(pre)
        first_at = time.perf_counter()
        ttft = (first_at - t0) * 1000
        tokens = 1
        dreq = DecodeRequest(
            rid, tuple(prompt), self.sampling, salt, result.handle, result.first_token_id,
            result.first_logprob, arrival_time=time.time(),
        )  # fmt: skip
        if self.decode_channel is None:
            async for ref in self.decode.generate.options(num_returns="streaming").remote(dreq):
                chunk = await ref
                tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    break
        else:
            stream = self.decode_channel.open_request(rid)
            try:
                await stream.submit(dreq)
                while True:
                    chunk = await stream.next()
                    tokens += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        break
            finally:
                stream.close()
        return Sample("direct", ttft, tpot_ms=tpot_ms(first_at, time.perf_counter(), tokens))

    async def run_rate(self, rate: float, n: int, seed: int) -> list[Sample]:
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            prompt = self.prompt(rng)
            # Interleave: alternate which path goes first within each pair of arrivals.
            path = self.via_grpc if (i % 2 == 0) ^ (i // 2 % 2 == 0) else self.direct
            tasks.append(asyncio.create_task(path(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    async def close(self) -> None:
        if self.decode_channel is not None:
            self.decode_channel.close("benchmark done")
        await self.channel.close()


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


async def _timed(fn: Any, n: int = 100) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.01)
    return percentile(times, 50), percentile(times, 99)


async def floors(redis_url: str, bench: Bench) -> dict[str, tuple[float, float]]:
    """What each hop the router adds costs here, now: a gRPC server-streaming call to a
    trivial server in another process, and the Redis prefix lookup the router makes; a plain
    Ray actor call (both paths make those) for scale."""
    import subprocess

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
        await bench.prefill.ping.remote()

    return {
        "gRPC call to a trivial server (first message)": grpc_hop,
        "Redis prefix lookup (4 blocks)": redis_hop,
        "Ray actor call (both paths)": await _timed(ray_call),
    }


def summarize(rate: float, samples: list[Sample]) -> dict[str, float]:
    g = [s.ttft_ms for s in samples if s.path == "grpc"]
    d = [s.ttft_ms for s in samples if s.path == "direct"]
    r = [s.router_ttft_ms for s in samples if s.path == "grpc"]
    gt = [s.tpot_ms for s in samples if s.path == "grpc"]
    dt = [s.tpot_ms for s in samples if s.path == "direct"]
    return {
        "tpot_grpc_p50": percentile(gt, 50), "tpot_direct_p50": percentile(dt, 50),
        "rate": rate,
        "n": len(g),
        "grpc_p50": percentile(g, 50), "grpc_p99": percentile(g, 99),
        "direct_p50": percentile(d, 50), "direct_p99": percentile(d, 99),
        "router_view_p50": percentile(r, 50),
        "overhead_p50": percentile(g, 50) - percentile(d, 50),
        "overhead_p99": percentile(g, 99) - percentile(d, 99),
    }  # fmt: skip


def print_table(rows: list[dict[str, float]], markdown: bool) -> None:
    head = ("rate (req/s)", "requests/path", "TTFT gRPC p50/p99 (ms)", "TTFT direct p50/p99 (ms)",
            "overhead p50 (ms)", "overhead p99 (ms)",
            "of p50: gRPC / orchestrator (ms)", "router process CPU (% of a core)",
            "router CPU per gRPC request (ms)", "TPOT p50 gRPC / direct (ms)")  # fmt: skip
    lines = []
    for row in rows:
        grpc_part = row["grpc_p50"] - row["router_view_p50"]
        orchestrator_part = row["router_view_p50"] - row["direct_p50"]
        lines.append((
            f"{row['rate']:g}", f"{row['n']:.0f}",
            f"{row['grpc_p50']:.2f} / {row['grpc_p99']:.2f}",
            f"{row['direct_p50']:.2f} / {row['direct_p99']:.2f}",
            f"{row['overhead_p50']:.2f}", f"{row['overhead_p99']:.2f}",
            f"{grpc_part:.2f} / {orchestrator_part:.2f}",
            f"{row['router_cpu'] * 100:.1f}",
            f"{row['router_cpu_per_request'] * 1000:.1f}",
            f"{row['tpot_grpc_p50']:.2f} / {row['tpot_direct_p50']:.2f}",
        ))  # fmt: skip
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        print("  ".join(head))
        for line in lines:
            print("  ".join(line))


def main() -> None:
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
    args = ap.parse_args()

    from bench_cluster import tiny_disaggregated

    from deploy.control.launch import Cluster, loopback_env

    loopback_env()
    options = tiny_disaggregated()
    import ray

    with Cluster(options) as cluster:
        assert cluster.endpoint is not None
        workers = ray.get(cluster.controller.list_workers.remote())
        router_pid = ray.get(cluster.routers[0].__ray_call__.remote(lambda _: os.getpid()))
        router_code = ray.get(
            cluster.routers[0].__ray_call__.remote(
                lambda _: sys.modules["router.orchestrator"].__file__
            )
        )
        if args.router_pid_file:  # e.g. for `py-spy record -p $(cat FILE)`
            Path(args.router_pid_file).write_text(str(router_pid))

        def router_cpu_s() -> float:
            return process_cpu_s(router_pid)

        async def run() -> tuple[list[dict[str, float]], dict[str, tuple[float, float]]]:
            bench = Bench(cluster.endpoint.target, workers, args)  # type: ignore[union-attr]
            try:
                await bench.run_rate(2.0 * len(args.rates.split(",")), args.warmup, seed=999)
                cpu0, t0 = router_cpu_s(), time.perf_counter()
                await asyncio.sleep(5.0)
                idle_cpu_per_s = (router_cpu_s() - cpu0) / (time.perf_counter() - t0)
                rows = []
                for i, rate in enumerate(float(r) for r in args.rates.split(",")):
                    cpu0, t0 = router_cpu_s(), time.perf_counter()
                    samples = await bench.run_rate(rate, args.requests, seed=args.seed + i)
                    cpu_s = router_cpu_s() - cpu0
                    row = summarize(rate, samples)
                    row["router_cpu"] = cpu_s / (time.perf_counter() - t0)
                    row["router_cpu_per_request"] = cpu_s / row["n"]
                    rows.append(row)
                floor = await floors(cluster.endpoint.redis_url, bench)  # type: ignore[union-attr]
                rows[0]["router_idle_cpu"] = idle_cpu_per_s
                return rows, floor
            finally:
                await bench.close()

        rows, floor = asyncio.run(run())
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
          f"prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
          f"{args.requests} requests per rate (half per path)")  # fmt: skip
    print(f"router code: {router_code}; direct path: {args.direct_path}")
    print(f"router process CPU when idle: {rows[0]['router_idle_cpu'] * 100:.1f}% of a core")
    print_table(rows, args.markdown)
    print("\nHops on this machine at the same time (p50 / p99 ms, 100 sequential calls each):")
    for name, (p50, p99) in floor.items():
        print(f"- {name}: {p50:.2f} / {p99:.2f}")


if __name__ == "__main__":
    main()
