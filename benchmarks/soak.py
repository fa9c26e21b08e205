"""Soak: steady load on a local cluster for a long time, every process's memory sampled.

A 1P1D cluster (tiny model, CPU; every prompt handed off) serves `--concurrency` closed-loop
clients for `--minutes`: prompts of random tokens under cache salts from a small set (so the
prefix cache fills, hits and evicts), random lengths, a share of the streams cancelled after
a few tokens. Every `--sample-s` the resident set size of each process of the cluster (the
controller, the routers, the workers, the embedded redis-server) is read with psutil.

Memory is flat when, after the warm-up (the first fifth of the run), no process's RSS grows
by more than `--max-growth-mb` (default 32 MB) from its warm-up sample to the mean of its last
three samples; each process's least-squares slope (MB/hour) is reported too.

    python benchmarks/soak.py --minutes 30 --out soak.json
    python benchmarks/soak.py --minutes 2 --sample-s 10         # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import psutil

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc


def processes(cluster: Any) -> dict[str, int]:
    """name -> pid of every process of the cluster."""
    import ray

    def pid_of(actor: Any) -> int:
        return int(ray.get(actor.__ray_call__.remote(lambda _: __import__("os").getpid())))

    out = {"controller": pid_of(cluster.controller)}
    for i, router in enumerate(cluster.routers):
        out[f"router-{i}"] = pid_of(router)
    for info, handle in ray.get(cluster.controller.list_workers.remote()):
        out[info.worker_id] = pid_of(handle)
    if cluster.redis is not None and cluster.redis.process is not None:
        out["redis-server"] = cluster.redis.process.pid
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            out[name] = float("nan")
    return out


async def load(target: str, concurrency: int, end: float, seed: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    rng = random.Random(seed)
    salts = [f"s{i}" for i in range(8)]

    async def client(stub: Any) -> None:
        while time.monotonic() < end:
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(20, 200))]
            req = pb.GenerateRequest(
                token_ids=prompt, max_tokens=rng.randrange(4, 48), temperature=0.0,
                ignore_eos=True, cache_salt=rng.choice(salts),
            )  # fmt: skip
            cancel_at = rng.randrange(1, 4) if rng.random() < 0.1 else None
            call = stub.Generate(req, timeout=120)
            status = "OK"
            try:
                n = 0
                async for msg in call:
                    n += len(msg.token_ids)
                    if cancel_at is not None and n >= cancel_at:
                        call.cancel()
            except asyncio.CancelledError:
                status = "CANCELLED"
            except grpc.aio.AioRpcError as e:
                status = e.code().name
            counts[status] = counts.get(status, 0) + 1

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
    return counts


def slope_mb_per_h(times: list[float], values: list[float]) -> float:
    n = len(times)
    mt, mv = sum(times) / n, sum(values) / n
    den = sum((t - mt) ** 2 for t in times) or 1.0
    return sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / den * 3600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--max-growth-mb", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from bench_cluster import tiny_disaggregated

    from deploy.cluster import Cluster
    from deploy.local_ray import loopback_env

    loopback_env()
    config = tiny_disaggregated(num_kv_blocks=256, worker_cpus=0, ray_cpus=None)
    with Cluster(config) as cluster:
        assert cluster.endpoint is not None
        pids = processes(cluster)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        samples: list[tuple[float, dict[str, float]]] = []

        async def run() -> dict[str, int]:
            task = asyncio.create_task(load(cluster.endpoint.target, args.concurrency, end,
                                            args.seed))  # fmt: skip
            while not task.done():
                samples.append((time.monotonic() - t0, rss_mb(pids)))
                print(f"{samples[-1][0]:7.0f}s " + " ".join(
                    f"{k}={v:.0f}" for k, v in samples[-1][1].items()), flush=True)  # fmt: skip
                await asyncio.wait([task], timeout=args.sample_s)
            return task.result()

        counts = asyncio.run(run())
        samples.append((time.monotonic() - t0, rss_mb(pids)))
    warm = args.minutes * 60 / 5
    report: dict[str, Any] = {"minutes": args.minutes, "requests": counts, "processes": {}}
    flat = True
    for name in pids:
        after = [(t, s[name]) for t, s in samples if t >= warm]
        if len(after) < 4:
            raise SystemExit("too few samples after the warm-up: run longer or sample more often")
        start = after[0][1]
        final = sum(v for _, v in after[-3:]) / 3
        growth = final - start
        slope = slope_mb_per_h([t for t, _ in after], [v for _, v in after])
        flat &= growth <= args.max_growth_mb
        report["processes"][name] = {
            "rss_warm_mb": round(start, 1), "rss_end_mb": round(final, 1),
            "growth_mb": round(growth, 1), "slope_mb_per_h": round(slope, 1),
        }  # fmt: skip
    report["flat"] = flat
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    raise SystemExit(0 if flat else 1)


if __name__ == "__main__":
    main()
