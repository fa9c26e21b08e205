"""The host KV tier (engine/host_tier.py): its copy rates, and multi-turn chat with it on vs off.

    python benchmarks/bench_host_tier.py copy [--device cuda]       # onboard/offload GB/s
    python benchmarks/bench_host_tier.py chat --model DIR --out OUT  # TTFT, tier on vs off

`copy`: a Llama-3-8B-shaped pool (32 layers, 8 KV heads, head dim 128, block 16, bf16: 2 MiB a
block) and a host tier; times `HostTier.onboard` of a session's blocks (host slots and device
blocks each ascending, as a returning session's are, and scattered) and the offload of the
same number of blocks on the side stream, against one plain pinned host→device (and
device→host) copy of the same bytes measured in the same run. On CPU the same code runs
(host memory both sides) as a smoke check.

`chat`: the whole system (Ray, Redis, router, gRPC, one colocated worker on one GPU) under the
`multi_turn_long` profile: sessions come back with their whole history plus a new turn, and
their histories add up to several times the (deliberately small) device pool
(`--num-kv-blocks`). One cluster with the tier off (`host_kv_gb=0`) and one with it on, same
workload and seed: TTFT p50/p90, prompt tokens recomputed, decode TPOT p50, and the worker's
tier counters. Writes OUT/results.json and the per-request records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- copy -----------------------------------------------------------------------------------


def _timed(fn, device, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `fn` over `reps` (CUDA events on GPU, wall clock on CPU)."""
    import torch

    fn()  # warm
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_copy(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from engine.host_tier import HostTier

    device = torch.device(args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu"))  # fmt: skip
    layers, heads, hd = (32, 8, 128) if not args.smoke else (2, 2, 16)
    shape = (layers, 2, 16, heads, hd)
    n = args.blocks
    device_kv = torch.zeros((2 * n, *shape), dtype=torch.bfloat16, device=device)
    tier = HostTier(2 * n, device_kv, max_blocks_per_step=n)
    nbytes = n * tier.block_nbytes
    # fill the host slots 0..n-1 from device blocks 0..n-1 (offers, one flush: the side stream)
    for b in range(n):
        tier.offer(b, b.to_bytes(16, "little"))

    def offload() -> None:
        tier._slots.clear()
        tier._hash_of = [None] * tier.num_blocks
        tier._free.clear()
        tier._free.extend(range(tier.num_blocks))
        for b in range(n):
            tier.offer(b, b.to_bytes(16, "little"))
        tier.flush()
        if device.type == "cuda":
            torch.cuda.current_stream().wait_stream(tier._stream)  # type: ignore[arg-type]

    t_off = _timed(offload, device, args.reps)
    ascending = [(s, n + s) for s in range(n)]
    g = torch.Generator().manual_seed(0)
    scattered = list(zip(range(n), (n + torch.randperm(n, generator=g)).tolist(), strict=True))
    t_on = _timed(lambda: tier.onboard(ascending), device, args.reps)
    t_on_scattered = _timed(lambda: tier.onboard(scattered), device, args.reps)
    pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    flat = device_kv.view(-1)[: nbytes // 2]
    t_h2d = _timed(lambda: flat.copy_(pinned, non_blocking=True), device, args.reps)
    t_d2h = _timed(lambda: pinned.copy_(flat, non_blocking=True), device, args.reps)
    out = {
        "device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
        "blocks": n,
        "block_mib": tier.block_nbytes / 2**20,
        "bytes": nbytes,
        "onboard_gbps": nbytes / t_on / 1e9,
        "onboard_scattered_gbps": nbytes / t_on_scattered / 1e9,
        "pinned_h2d_gbps": nbytes / t_h2d / 1e9,
        "offload_gbps": nbytes / t_off / 1e9,
        "pinned_d2h_gbps": nbytes / t_d2h / 1e9,
    }
    out["onboard_vs_copy"] = out["onboard_gbps"] / out["pinned_h2d_gbps"]
    out["onboard_scattered_vs_copy"] = out["onboard_scattered_gbps"] / out["pinned_h2d_gbps"]
    out["offload_vs_copy"] = out["offload_gbps"] / out["pinned_d2h_gbps"]
    log(
        f"copy {n} blocks x {out['block_mib']:.2f} MiB on {out['device']}: onboard "
        f"{out['onboard_gbps']:.1f} GB/s ({out['onboard_vs_copy']:.0%} of the pinned copy's "
        f"{out['pinned_h2d_gbps']:.1f}), scattered {out['onboard_scattered_gbps']:.1f} GB/s "
        f"({out['onboard_scattered_vs_copy']:.0%}); offload {out['offload_gbps']:.1f} GB/s "
        f"({out['offload_vs_copy']:.0%} of {out['pinned_d2h_gbps']:.1f})"
    )
    return out


# ---- chat -----------------------------------------------------------------------------------


def chat_workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The planned requests of the chat run (the same for tier off and on, and the working set)."""
    from loadtests.workload import generate, load_profile

    return generate(
        load_profile(args.profile), rate=args.rate, duration_s=args.duration, seed=args.seed
    )


def chat_options(args: argparse.Namespace, host_kv_gb: float):  # type: ignore[no-untyped-def]
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.config import LaunchConfig, PdserveConfig
    from deploy.spec import ClusterSpec
    from engine.config import EngineConfig
    from router.server import RouterConfig

    engine = EngineConfig(
        model_dir=args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.token_budget,
        max_model_len=8192,
        num_kv_blocks=args.num_kv_blocks,
        host_kv_gb=host_kv_gb,
        load_format=args.load_format,
    )
    thresholds = AdmissionThresholds(
        max_estimated_ttft_ms=600_000.0, max_queue_wait_ms=600_000.0,
        max_inflight_requests=4096, max_decode_kv_utilization=1.0,
    )  # fmt: skip
    return PdserveConfig(
        model=args.model,
        cluster=LaunchConfig(object_store_bytes=2 << 30),
        router=RouterConfig(
            grpc_port=0, metrics_port=None, admission=AdmissionConfig(thresholds=thresholds)
        ),
        workers=ClusterSpec(engine=engine, num_prefill=0, num_decode=1, colocated=True),
    )


def worker_engine_load(cluster):  # type: ignore[no-untyped-def]
    import ray

    [(_, handle)] = ray.get(cluster.controller.list_workers.remote())
    return ray.get(handle.__ray_call__.remote(lambda actor: actor.runtime.driver.load))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def run_chat(args: argparse.Namespace, host_kv_gb: float, out: Path) -> dict:  # type: ignore[type-arg]
    from deploy.cluster import Cluster
    from loadtests.driver import run_planned
    from loadtests.records import write_records
    from loadtests.workload import generate, load_profile

    planned = chat_workload(args)
    warm = generate(load_profile("synthetic"), rate=4.0, duration_s=1.0, seed=99)
    label = "on" if host_kv_gb else "off"
    with Cluster(chat_options(args, host_kv_gb)) as cluster:
        assert cluster.endpoint is not None
        target = cluster.endpoint.target
        asyncio.run(run_planned(target, warm, offered_rate=4.0, timeout_s=args.timeout))
        before = worker_engine_load(cluster)
        t0 = time.time()
        records = asyncio.run(
            run_planned(target, planned, offered_rate=args.rate, timeout_s=args.timeout)
        )
        wall = time.time() - t0
        after = worker_engine_load(cluster)
    write_records(out / f"records-tier-{label}.jsonl", records)
    ok = [r for r in records if r.ok and r.ttft_ms is not None]
    returning = [r for r in ok if r.conversation is not None and r.prompt_tokens > 0]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    tier = after.host_tier
    result = {
        "host_kv_gb": host_kv_gb,
        "requests": len(records),
        "ok": len(ok),
        "wall_s": wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p90_ms": pct(tpot, 90),
        "prompt_tokens": sum(r.prompt_tokens for r in returning),
        "recomputed_tokens": sum(r.prompt_tokens - r.cached_prompt_tokens for r in returning),
        "host_hit_tokens": after.num_host_hit_tokens - before.num_host_hit_tokens,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "tier": None if tier is None else {
            "blocks": tier.num_blocks, "offloaded": tier.num_offloaded,
            "onboarded": tier.num_onboarded, "evicted": tier.num_evicted,
            "fenced_steps": tier.num_fenced,
        },
    }  # fmt: skip
    log(
        f"tier {label}: {result['ok']}/{result['requests']} ok in {wall:.0f}s, TTFT p50/p90 "
        f"{result['ttft_p50_ms']:.0f}/{result['ttft_p90_ms']:.0f} ms, TPOT p50 "
        f"{result['tpot_p50_ms']:.2f} ms, recomputed {result['recomputed_tokens']} of "
        f"{result['prompt_tokens']} prompt tokens, host hits {result['host_hit_tokens']}, "
        f"tier {result['tier']}"
    )
    return result


def working_set(args: argparse.Namespace) -> dict[str, float]:
    """Distinct history tokens of the workload's sessions vs the device pool's tokens."""
    from collections import defaultdict

    planned = chat_workload(args)
    longest: dict[int, int] = defaultdict(int)
    for p in planned:
        key = p.conversation if p.conversation is not None else -p.index - 1
        longest[key] = max(longest[key], p.prompt_tokens + p.max_tokens)
    pool_tokens = args.num_kv_blocks * 16
    total = sum(longest.values())
    return {"sessions": len(longest), "history_tokens": total, "pool_tokens": pool_tokens,
            "ratio": total / pool_tokens}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("part", choices=("copy", "chat", "all"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--blocks", type=int, default=1024, help="copy: blocks per copy")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="copy: a tiny block shape")
    ap.add_argument("--model", default="/tmp/llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--profile", default="multi_turn_long")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=2048, help="chat: the device pool")
    ap.add_argument("--host-kv-gb", type=float, default=32.0, help="chat: the tier when on")
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="bench-results/host-tier")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}  # type: ignore[type-arg]
    if args.part in ("copy", "all"):
        results["copy"] = bench_copy(args)
    if args.part in ("chat", "all"):
        results["working_set"] = ws = working_set(args)
        log(
            f"workload: {ws['sessions']} sessions, {ws['history_tokens']} history tokens = "
            f"{ws['ratio']:.1f}x the {ws['pool_tokens']}-token device pool"
        )
        off = run_chat(args, 0.0, out)
        on = run_chat(args, args.host_kv_gb, out)
        results["chat"] = {"off": off, "on": on}
        results["ttft_p50_off_over_on"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        results["ttft_p90_off_over_on"] = off["ttft_p90_ms"] / on["ttft_p90_ms"]
        results["tpot_p50_on_over_off"] = on["tpot_p50_ms"] / off["tpot_p50_ms"]
        log(
            f"TTFT p50 {results['ttft_p50_off_over_on']:.2f}x lower with the tier, p90 "
            f"{results['ttft_p90_off_over_on']:.2f}x; TPOT p50 on/off "
            f"{results['tpot_p50_on_over_off']:.3f}"
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
