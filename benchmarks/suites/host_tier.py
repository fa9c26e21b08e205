"""The host KV tier (engine/kv/host_tier.py): its copy rates, and multi-turn chat with it on vs off.

    python -m benchmarks host_tier copy [--device cuda]       # onboard/offload GB/s
    python -m benchmarks host_tier plan                        # the chat workload (CPU)
    python -m benchmarks host_tier chat --model DIR --out OUT  # TTFT, tier on vs off

`copy`: a Llama-3-8B-shaped pool (32 layers, 8 KV heads, head dim 128, block 16, bf16: 2 MiB a
block) in each of `--layouts` (block-major; layer-major, a GPU's default: a block is 32
pieces) and a host tier; times `HostTier.onboard` of a session's blocks (host slots and
device blocks each ascending, as a returning session's are, and scattered) and the offload of
the same number of scattered device blocks (as a step's given-back blocks are) on the side
stream, against one plain pinned host→device (and device→host) copy of the same bytes
measured in the same run; and the offload's copies and host time (what the engine's thread
spends queueing them before a step) against the piece-by-piece copies the tier made before
its staging buffer (engine/kv/block_mover.py). On CPU the same code runs (host memory both
sides) as a smoke check.

`plan` (CPU, no cluster): what the chat workload asks of the tier, before any run: requests,
first vs returning turns, the prompt tokens a returning turn can reuse at best (its previous
turn's prompt), the working set alive at once vs the device pool, and a replay of the
workload through an LRU device pool with and without an LRU host tier (block hashes, send
order): the device and host hits to expect, and what a returning turn pays for its history
(recompute at `--prefill-tok-s` vs onboard at `--onboard-gbps`). The replay is what shows
whether a workload exercises the tier at all: with open sessions that start over the whole
run, most returning turns find their history still on the device even without the tier, which
is why `chat` uses closed sessions (docs/benchmarks.md, "Host KV tier").

`chat`: the whole system (Ray, Redis, router, gRPC, one colocated worker on one GPU) under the
`multi_turn_long` profile: closed sessions that come back with their whole history plus a new
turn, all alive at once, their histories several times the (deliberately small) device pool
(`--num-kv-blocks`). One cluster with the tier off (`host_kv_gb=0`) and one with it on
(`--tiers`; each alone fits one ~3 minute device call), same workload and seed: TTFT p50/p90
over all requests and over returning turns, prompt tokens recomputed, decode TPOT p50, and the
worker's tier counters. Writes OUT/results-<tiers>.json and the per-request records.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness.steps import progress as log
from vocabulary.numeric import percentile
from vocabulary.step_stats import StepStats

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig
    from deploy.control.launch import Cluster
    from loadtests.records import RequestRecord
    from loadtests.workload import PlannedRequest

GIB = 2**30


# ---- copy -----------------------------------------------------------------------------------


def bench_copy(args: argparse.Namespace) -> dict[str, Any]:
    """`copy` in each of `--layouts` (module docstring)."""
    layouts = [x for x in args.layouts.split(",") if x]
    return {layout: copy_in_layout(args, layout) for layout in layouts}


def copy_in_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    import torch

    from benchmarks.harness.cuda_timing import median_seconds
    from engine.kv.host_tier import HostTier
    from engine.kv.kv_cache import block_segments
    from vocabulary.block_hash import BlockHash

    device = torch.device(args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu"))  # fmt: skip
    layers, heads, hd = (32, 8, 128) if not args.smoke else (2, 2, 16)
    n = args.blocks
    page = (2, 16, heads, hd)
    block_dim = 1 if layout == "layer_major" else 0
    shape = (layers, 2 * n, *page) if block_dim else (2 * n, layers, *page)
    device_kv = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    tier = HostTier(2 * n, device_kv, max_blocks_per_step=n, block_dim=block_dim)
    nbytes = n * tier.block_nbytes
    g = torch.Generator().manual_seed(0)
    scattered_blocks = torch.randperm(2 * n, generator=g)[:n].tolist()  # a step's freed blocks

    def num_copies() -> int:
        return sum(m.num_copies for m in tier._movers)

    def offload() -> None:  # n scattered device blocks into fresh host slots (side stream)
        tier._slots.clear()
        tier._hash_of = [None] * tier.num_blocks
        tier._free.clear()
        tier._free.extend(range(tier.num_blocks))
        for b in scattered_blocks:
            tier.offer(b, BlockHash(b.to_bytes(16, "little")))
        tier.flush()
        if device.type == "cuda":
            torch.cuda.current_stream().wait_stream(tier._stream)  # type: ignore[arg-type]

    host_segments = block_segments(tier.tensor, block_dim)
    device_segments = block_segments(device_kv, block_dim)

    def piecewise() -> None:  # the copies before the staging buffer: a segment of a block each
        for slot, b in enumerate(scattered_blocks):
            for host, dev in zip(host_segments, device_segments, strict=True):
                host[slot].copy_(dev[b], non_blocking=True)

    copies = num_copies()
    t_off = median_seconds(offload, device, args.reps)
    copies_per_offload = (num_copies() - copies) // (args.reps + 1)
    t_piece = median_seconds(piecewise, device, args.reps)
    host_off, host_piece = (
        host_seconds(offload, device, args.reps),
        host_seconds(piecewise, device, args.reps),
    )
    ascending = [(s, n + s) for s in range(n)]
    scattered = list(zip(range(n), scattered_blocks, strict=True))
    t_on = median_seconds(lambda: tier.onboard(ascending), device, args.reps)
    t_on_scattered = median_seconds(lambda: tier.onboard(scattered), device, args.reps)
    pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    flat = device_kv.view(-1)[: nbytes // 2]
    t_h2d = median_seconds(lambda: flat.copy_(pinned, non_blocking=True), device, args.reps)
    t_d2h = median_seconds(lambda: pinned.copy_(flat, non_blocking=True), device, args.reps)
    out: dict[str, Any] = {
        "device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
        "layout": layout,
        "blocks": n,
        "block_mib": tier.block_nbytes / 2**20,
        "bytes": nbytes,
        "onboard_gbps": nbytes / t_on / 1e9,
        "onboard_scattered_gbps": nbytes / t_on_scattered / 1e9,
        "pinned_h2d_gbps": nbytes / t_h2d / 1e9,
        "offload_gbps": nbytes / t_off / 1e9,
        "pinned_d2h_gbps": nbytes / t_d2h / 1e9,
        "offload_copies": copies_per_offload,
        "offload_host_ms": host_off * 1e3,
        "piecewise_gbps": nbytes / t_piece / 1e9,
        "piecewise_copies": n * len(device_segments),
        "piecewise_host_ms": host_piece * 1e3,
    }
    out["onboard_vs_copy"] = out["onboard_gbps"] / out["pinned_h2d_gbps"]
    out["onboard_scattered_vs_copy"] = out["onboard_scattered_gbps"] / out["pinned_h2d_gbps"]
    out["offload_vs_copy"] = out["offload_gbps"] / out["pinned_d2h_gbps"]
    log(
        f"copy {n} blocks x {out['block_mib']:.2f} MiB, {layout}, on {out['device']}: onboard "
        f"{out['onboard_gbps']:.1f} GB/s ({out['onboard_vs_copy']:.0%} of the pinned copy's "
        f"{out['pinned_h2d_gbps']:.1f}), scattered {out['onboard_scattered_gbps']:.1f} GB/s "
        f"({out['onboard_scattered_vs_copy']:.0%}); offload of scattered blocks "
        f"{out['offload_gbps']:.1f} GB/s ({out['offload_vs_copy']:.0%} of "
        f"{out['pinned_d2h_gbps']:.1f}) in {copies_per_offload} copies, "
        f"{out['offload_host_ms']:.2f} ms of host time; piecewise "
        f"{out['piecewise_gbps']:.1f} GB/s in {out['piecewise_copies']} copies, "
        f"{out['piecewise_host_ms']:.2f} ms of host time"
    )
    return out


def host_seconds(fn: Any, device: Any, reps: int) -> float:
    """Median seconds the calling thread spends in `fn` (queueing its copies; the device
    finishes them after, outside the figure)."""
    import torch

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(times)


# ---- plan -----------------------------------------------------------------------------------


def replay_lru(
    planned: list[PlannedRequest], pool_blocks: int, host_blocks: int, block_size: int = 16
) -> dict[int, tuple[int, int]]:
    """Replay the workload (send order) through an LRU device pool of `pool_blocks` and an LRU
    host tier of `host_blocks` (0: none) that keeps what the device evicts: per request, the
    leading blocks found on the device and then in the host tier."""
    from collections import OrderedDict

    from vocabulary.block_hash import hash_chain

    device: OrderedDict[bytes, None] = OrderedDict()
    host: OrderedDict[bytes, None] = OrderedDict()
    hits: dict[int, tuple[int, int]] = {}
    for p in sorted(planned, key=lambda p: (p.send_at_s, p.index)):
        chain = hash_chain(p.token_ids[: p.prompt_tokens - 1], block_size, b"plan")
        on_device = next((i for i, h in enumerate(chain) if h not in device), len(chain))
        in_host = next(
            (i for i, h in enumerate(chain[on_device:]) if h not in host), len(chain) - on_device
        )
        hits[p.index] = (on_device, in_host)
        for h in hash_chain(p.token_ids, block_size, b"plan"):  # (its reply is not reused)
            device[h] = None
            device.move_to_end(h)
            while len(device) > pool_blocks:
                evicted, _ = device.popitem(last=False)
                if host_blocks:
                    host[evicted] = None
                    host.move_to_end(evicted)
                    while len(host) > host_blocks:
                        host.popitem(last=False)
    return hits


def plan_workload(args: argparse.Namespace) -> dict[str, Any]:
    """What the chat workload asks of the tier (module docstring, `plan`)."""
    planned = chat_workload(args)
    bs = 16
    sessions: dict[int, list[PlannedRequest]] = {}
    for p in planned:  # (send order: a session's turns in turn order)
        key = p.conversation if p.conversation is not None else -1 - p.index
        sessions.setdefault(key, []).append(p)
    # A returning turn can reuse at best its previous turn's prompt (full blocks).
    reusable = {
        b.index: a.prompt_tokens // bs * bs
        for turns in sessions.values()
        for a, b in itertools.pairwise(turns)
    }
    returning = [p for p in planned if p.index in reusable]
    # Alive at once: a session from its first send to its last, at its longest history.
    changes: list[tuple[float, int]] = []
    for turns in sessions.values():
        size = turns[-1].prompt_tokens + turns[-1].max_tokens
        changes += [(turns[0].send_at_s, size), (turns[-1].send_at_s + 1e-9, -size)]
    alive = peak = 0
    for _, delta in sorted(changes):
        alive += delta
        peak = max(peak, alive)
    host_blocks = int(args.host_kv_gb * GIB // args.block_mib // 2**20)
    off = replay_lru(planned, args.num_kv_blocks, 0, bs)
    on = replay_lru(planned, args.num_kv_blocks, host_blocks, bs)
    ret_prompt = sum(p.prompt_tokens for p in returning)
    history = statistics.median(list(reusable.values()) or [0])
    new = statistics.median([p.prompt_tokens - reusable[p.index] for p in returning] or [0])
    recompute_ms = (history + new) / args.prefill_tok_s * 1000
    onboard_ms = history / bs * args.block_mib * 2**20 / (args.onboard_gbps * 1e9) * 1000
    new_ms = new / args.prefill_tok_s * 1000
    out = {
        "requests": len(planned),
        "first_turns": len(planned) - len(returning),
        "returning_turns": len(returning),
        "prompt_tokens": sum(p.prompt_tokens for p in planned),
        "returning_prompt_tokens": ret_prompt,
        "returning_reusable_tokens": sum(reusable.values()),
        "peak_alive_history_tokens": peak,
        "pool_tokens": args.num_kv_blocks * bs,
        "alive_over_pool": peak / (args.num_kv_blocks * bs),
        "tier_off_device_hit_tokens": sum(off[p.index][0] * bs for p in returning),
        "tier_on_device_hit_tokens": sum(on[p.index][0] * bs for p in returning),
        "tier_on_host_hit_tokens": sum(on[p.index][1] * bs for p in returning),
        "median_history_tokens": history,
        "median_new_tokens": new,
        "est_recompute_ms": recompute_ms,
        "est_onboard_ms": onboard_ms,
        "est_new_tokens_ms": new_ms,
    }
    log(
        f"plan: {out['requests']} requests ({out['first_turns']} first turns, "
        f"{out['returning_turns']} returning); returning turns reuse at best "
        f"{out['returning_reusable_tokens']} of {ret_prompt} prompt tokens; alive at once "
        f"{peak} history tokens = {out['alive_over_pool']:.1f}x the pool. LRU replay: tier off "
        f"{out['tier_off_device_hit_tokens']} device-hit tokens; tier on "
        f"{out['tier_on_device_hit_tokens']} device + {out['tier_on_host_hit_tokens']} host. A "
        f"median returning turn: {history:.0f} history + {new:.0f} new tokens: recompute "
        f"~{recompute_ms:.0f} ms vs onboard ~{onboard_ms:.1f} ms + {new_ms:.0f} ms"
    )
    return out


# ---- chat -----------------------------------------------------------------------------------


def chat_workload(args: argparse.Namespace) -> list[PlannedRequest]:
    """The planned requests of the chat run (the same for tier off and on, and the working set)."""
    from loadtests.workload import generate, load_profile

    return generate(
        load_profile(args.profile), rate=args.rate, duration_s=args.duration, seed=args.seed
    )


def chat_options(args: argparse.Namespace, host_kv_gb: float) -> PdserveConfig:
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from engine.config import EngineConfig
    from router.router_server import RouterConfig

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


def worker_engine_load(cluster: Cluster) -> Any:
    import ray

    [(_, handle)] = ray.get(cluster.controller.list_workers.remote())
    return ray.get(handle.__ray_call__.remote(lambda actor: actor.runtime.driver.load))


def run_chat(args: argparse.Namespace, host_kv_gb: float, out: Path) -> dict[str, Any]:
    from deploy.control.launch import Cluster
    from loadtests.load_driver import run_planned
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
    returning = [r for r in ok if r.turn > 0]
    tier = after.host_tier
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    result = {
        "host_kv_gb": host_kv_gb,
        "requests": len(records),
        "ok": len(ok),
        "returning_ok": len(returning),
        "wall_s": wall,
        "ttft_ms": ttft_pcts(ok),
        "ttft_returning_ms": ttft_pcts(returning),
        "ttft_first_turn_ms": ttft_pcts([r for r in ok if r.turn == 0]),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p90_ms": percentile(tpot, 90),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "recomputed_tokens": sum(r.prompt_tokens - r.cached_prompt_tokens for r in ok),
        "returning_prompt_tokens": sum(r.prompt_tokens for r in returning),
        "returning_recomputed_tokens": sum(
            r.prompt_tokens - r.cached_prompt_tokens for r in returning
        ),
        "host_hit_tokens": after.num_host_hit_tokens - before.num_host_hit_tokens,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "tier": None if tier is None else {
            "blocks": tier.num_blocks, "offloaded": tier.num_offloaded,
            "onboarded": tier.num_onboarded, "evicted": tier.num_evicted,
            "fenced_steps": tier.num_fenced,
            # where a returning turn can wait: its onboard refused by the budget (deferred,
            # wait_s), offloads deferred or queued behind the per-step cap
            "onboard": asdict(tier.onboard), "offload": asdict(tier.offload),
        },
        "steps": step_breakdown(before.steps, after.steps),
    }  # fmt: skip
    log(
        f"tier {label}: {result['ok']}/{result['requests']} ok in {wall:.0f}s, TTFT p50/p90 "
        f"all {result['ttft_ms']} returning {result['ttft_returning_ms']} ms, TPOT p50 "
        f"{result['tpot_p50_ms']:.2f} ms, recomputed {result['returning_recomputed_tokens']} of "
        f"{result['returning_prompt_tokens']} returning prompt tokens, host hits "
        f"{result['host_hit_tokens']}, tier {result['tier']}"
    )
    return result


def step_breakdown(before: StepStats, after: StepStats) -> dict[str, float]:
    """The engine's steps over the timed run: how many, their mean time, and the tokens they
    computed (prefill tokens are what the tier saves; a slower step is what it costs)."""
    steps = after.num_steps - before.num_steps
    seconds = after.step_seconds - before.step_seconds
    return {
        "steps": steps,
        "busy_s": seconds,
        "mean_step_ms": 1e3 * seconds / max(steps, 1),
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "decode_tokens": after.decode_tokens - before.decode_tokens,
        "mean_batch": (after.batch_requests - before.batch_requests) / max(steps, 1),
    }


def ttft_pcts(records: list[RequestRecord]) -> dict[str, float]:
    values = [r.ttft_ms for r in records if r.ttft_ms is not None]
    return {"p50": percentile(values, 50), "p90": percentile(values, 90)} if values else {}


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    """Tier off over tier on (TTFT: how many times lower with the tier), TPOT on over off."""
    return {
        "ttft_p50_off_over_on": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
        "ttft_p90_off_over_on": off["ttft_ms"]["p90"] / on["ttft_ms"]["p90"],
        "returning_ttft_p50_off_over_on": (
            off["ttft_returning_ms"]["p50"] / on["ttft_returning_ms"]["p50"]
        ),
        "returning_ttft_p90_off_over_on": (
            off["ttft_returning_ms"]["p90"] / on["ttft_returning_ms"]["p90"]
        ),
        "tpot_p50_on_over_off": on["tpot_p50_ms"] / off["tpot_p50_ms"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("part", choices=("copy", "plan", "chat", "all"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--blocks", type=int, default=1024, help="copy: blocks per copy")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="copy: a tiny block shape")
    ap.add_argument("--layouts", default="block_major,layer_major", help="copy: pool layouts")
    ap.add_argument("--model", default="/tmp/llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--profile", default="multi_turn_long")
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=1536, help="chat: the device pool")
    ap.add_argument("--host-kv-gb", type=float, default=32.0, help="chat: the tier when on")
    ap.add_argument("--tiers", default="off,on", help="chat: which runs (off, on or both)")
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--block-mib", type=float, default=2.0, help="plan: KV block size (8B: 2)")
    ap.add_argument("--prefill-tok-s", type=float, default=37_000.0, help="plan: H200 8B prefill")
    ap.add_argument("--onboard-gbps", type=float, default=55.0, help="plan: H200 onboard")
    ap.add_argument("--out", default="bench-results/host-tier")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if args.part in ("copy", "all"):
        results["copy"] = bench_copy(args)
    if args.part in ("plan", "chat", "all"):
        results["plan"] = plan_workload(args)
    if args.part in ("chat", "all"):
        tiers = [t for t in args.tiers.split(",") if t]
        if not set(tiers) <= {"off", "on"}:
            ap.error(f"--tiers: off and/or on, got {args.tiers!r}")
        for label in tiers:
            run = run_chat(args, args.host_kv_gb if label == "on" else 0.0, out)
            (out / f"chat-{label}.json").write_text(json.dumps(run, indent=2))
        # Runs made by separate calls (--tiers off, then --tiers on) meet in OUT.
        runs = {t: out / f"chat-{t}.json" for t in ("off", "on")}
        if all(path.exists() for path in runs.values()):
            off, on = (json.loads(runs[t].read_text()) for t in ("off", "on"))
            results["chat"] = {"off": off, "on": on}
            results["ratios"] = r = compare(off, on)
            log(
                f"TTFT p50 {r['ttft_p50_off_over_on']:.2f}x lower with the tier (returning "
                f"turns {r['returning_ttft_p50_off_over_on']:.2f}x), p90 "
                f"{r['ttft_p90_off_over_on']:.2f}x ({r['returning_ttft_p90_off_over_on']:.2f}x); "
                f"TPOT p50 on/off {r['tpot_p50_on_over_off']:.3f}"
            )
    (out / f"results-{args.part}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0
