"""KV transfer benchmark: NIXL READ GB/s vs a plain copy of the same bytes; Redis lookup latency.

The KV of a 4k-token Llama-3-8B prompt in the real block layout (32 layers, 8 kv heads,
head_dim 128, bf16, block 16: 2 MiB per block, 256 blocks = 512 MiB). A prefill process owns
the source pool (a `PrefillEndpoint`, as in production); this process pulls it with the
project's `NixlBackend` (tight poll loop) in each descriptor mode, then end to end through a
`DecodeEndpoint` (submit → on_done, includes the loop's poll interval), and times a plain
copy of the same number of bytes in the same run.

CPU (default): host pools, UCX over shm/tcp on loopback; raw = torch `copy_` (memcpy), plus
Redis lookup p50/p99 for a 4k-token chain (256 blocks) against a loopback redis-server.
GPU (`--gpu`, 2 GPUs): pools in VRAM on cuda:0 (prefill process) and cuda:1 (this process);
UCX picks cuda_ipc (UCX_TLS is not touched); raw = `copy_` from cuda:0 to cuda:1.
Goal: NIXL coalesced >= 85% of the raw copy. Every stage catches and prints its own failure.

    python benchmarks/bench_kv_transfer.py               # CPU + Redis
    python benchmarks/bench_kv_transfer.py --gpu         # 2-GPU NIXL VRAM->VRAM

Measured on the 2-core CPU machine (2026-11-30, other jobs running; figures are noisy there):
see `docs/benchmarks.md` / the report of issue 4 for the table this script printed.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.block_hash import hash_chain, hash_extra
from engine.kv_cache import KVCache, KVCacheSpec, torch_dtype
from kv_transfer.protocol import HandshakeInfo

MODEL = "llama-3-8b-shape"
Row = tuple[str, int, str, float, float, float]  # name, bytes, descriptors, ms, GB/s, best GB/s


def make_spec(args: argparse.Namespace) -> KVCacheSpec:
    return KVCacheSpec(
        num_blocks=args.blocks * 2,  # room for a scattered placement of the same blocks
        num_layers=args.layers,
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
    )


def expected_block(spec: KVCacheSpec, block_id: int, device: torch.device) -> torch.Tensor:
    """The pattern the prefill process writes: flat element i of the pool is i % 251."""
    numel = spec.block_nbytes // spec.element_size
    idx = torch.arange(block_id * numel, (block_id + 1) * numel, device=device) % 251
    return idx.to(torch_dtype(spec.dtype)).view(spec.shape[1:])


def prefill_process(conn: Connection, spec: KVCacheSpec, device: str) -> None:
    """Own the source pool behind a PrefillEndpoint; answer hand_off requests."""
    try:
        from kv_transfer.prefill_endpoint import PrefillEndpoint

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        cache = KVCache(spec, device)
        for b in range(spec.num_blocks):
            cache.tensor[b].copy_(expected_block(spec, b, cache.device))
        endpoint = PrefillEndpoint(cache, MODEL, "bench-prefill", lambda r, b: None)
        conn.send(("ready", endpoint.start()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = conn.recv()
        if cmd == "hand_off":
            rid, blocks = args
            conn.send(endpoint.hand_off(rid, blocks, [], len(blocks) * spec.block_size, 60.0))
        else:
            endpoint.close()
            return


def stage(name: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """Run one stage; print its failure (with a hint) instead of aborting the benchmark."""
    try:
        return fn()
    except Exception as e:
        print(f"\n!! FAILED: {name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        if "UCX" in str(e) or "NIXL" in str(e) or "nixl" in type(e).__module__:
            print(f"   hint: UCX_TLS={os.environ.get('UCX_TLS')!r} (unset on GPU; shm,tcp on CPU)")
        return []


def summarize(name: str, nbytes: int, descs: str, times: list[float]) -> Row:
    med = statistics.median(times)
    return (name, nbytes, descs, med * 1e3, nbytes / med / 1e9, nbytes / min(times) / 1e9)


def bench_backend_modes(
    args: argparse.Namespace, spec: KVCacheSpec, info: HandshakeInfo, device: torch.device
) -> list[Row]:
    from kv_transfer.backend import DescriptorMode, XferStatus
    from kv_transfer.nixl_backend import NixlBackend
    from kv_transfer.plan import plan_transfer
    from kv_transfer.types import KVHandle

    cache = KVCache(spec, device)
    backend = NixlBackend("bench-decode-direct", cache, capture_telemetry=True)
    backend.add_peer(info.agent_name, info.agent_metadata, info.region)
    n = args.blocks
    perm = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(0))
    cases = [
        ("NIXL prepped, contiguous (merged)", DescriptorMode.PREPPED, list(range(n))),
        ("NIXL initialize_xfer, coalesced", DescriptorMode.COALESCED, list(range(n))),
        ("NIXL initialize_xfer, per block", DescriptorMode.PER_BLOCK, list(range(n))),
        ("NIXL prepped, scattered blocks", DescriptorMode.PREPPED, perm[:n].tolist()),
    ]
    rows: list[Row] = []
    for name, mode, remote in cases:
        local = list(range(n)) if "scattered" not in name else perm[n : 2 * n].tolist()
        handle = KVHandle("bench", "p", info.agent_name, tuple(remote), (), n, 0.0, "")
        plan = plan_transfer(handle, local, spec.block_nbytes)
        backend.mode = mode
        times, posted = [], None
        for i in range(args.warmup + args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            xfer = backend.start_read(plan, b"")
            while (status := backend.poll(xfer)) is XferStatus.IN_PROGRESS:
                pass
            elapsed = time.perf_counter() - t0
            if status is not XferStatus.DONE:
                raise RuntimeError(f"{name}: read ended {status}")
            posted = backend.descriptor_count(xfer)
            backend.release(xfer)
            if i >= args.warmup:
                times.append(elapsed)
        check = [0, n // 2, n - 1]
        for j in check:
            want = expected_block(spec, remote[j], device)
            if not torch.equal(cache.tensor[local[j]], want):
                raise RuntimeError(f"{name}: block {remote[j]} -> {local[j]} bytes differ")
        descs = f"{posted} ({plan.num_descriptors})"
        rows.append(summarize(name, plan.nbytes, descs, times))
        print(f"  {name}: {rows[-1][4]:.1f} GB/s (bytes verified)", flush=True)
    backend.close()
    return rows


def bench_endpoint(
    args: argparse.Namespace,
    spec: KVCacheSpec,
    info: HandshakeInfo,
    conn: Connection,
    device: torch.device,
) -> list[Row]:
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.decode_endpoint import DecodeEndpoint
    from kv_transfer.manager import TransferOutcome

    done = threading.Event()
    outcomes: list[TransferOutcome] = []

    def on_outcome(o: TransferOutcome) -> None:
        outcomes.append(o)
        done.set()

    cache = KVCache(spec, device)
    endpoint = DecodeEndpoint(
        cache, MODEL, "bench-decode", on_outcome, on_outcome, KVTransferConfig()
    )
    endpoint.start()
    endpoint.add_peer(info)
    times = []
    blocks = list(range(args.blocks))
    for i in range(args.warmup + args.iters):
        conn.send(("hand_off", f"e2e-{i}", blocks))
        handle = conn.recv()
        done.clear()
        t0 = time.perf_counter()
        endpoint.submit(handle, blocks)
        if not done.wait(60):
            raise RuntimeError("no outcome within 60 s")
        elapsed = time.perf_counter() - t0
        if outcomes[-1].error is not None:
            raise outcomes[-1].error
        if i >= args.warmup:
            times.append(elapsed)
    endpoint.close()
    nbytes = args.blocks * spec.block_nbytes
    return [summarize("DecodeEndpoint submit -> on_done", nbytes, "1", times)]


def bench_raw_copy(args: argparse.Namespace, spec: KVCacheSpec, gpu: bool) -> list[Row]:
    nbytes = args.blocks * spec.block_nbytes
    src_dev, dst_dev = ("cuda:0", "cuda:1") if gpu else ("cpu", "cpu")
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    rows: list[Row] = []
    for name, op in [
        ("raw copy_ " + ("cuda:0 -> cuda:1" if gpu else "(memcpy)"), lambda: dst.copy_(src)),
        *([("raw tensor.to('cuda:1')", lambda: src.to(dst_dev))] if gpu else []),
    ]:
        times = []
        for i in range(args.warmup + args.iters):
            if gpu:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            op()
            if gpu:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        rows.append(summarize(name, nbytes, "-", times))
    return rows


def bench_redis(args: argparse.Namespace) -> list[Row]:
    from deploy.redis_server import EmbeddedRedis
    from engine.kv_events import KVEvent, KVEventKind
    from kv_transfer.kv_publisher import KVEventPublisher
    from kv_transfer.prefix_index import PrefixIndex

    chain = hash_chain(list(range(4096)), 16, hash_extra(MODEL))
    with EmbeddedRedis() as server:
        publishers = []
        for w, prefix in enumerate([256, 200, 64, 16]):  # 4 live workers, different prefixes
            pub = KVEventPublisher(server.url, MODEL, f"w{w}", lambda: (-1, []))
            pub.start()
            pub.publish([KVEvent(0, KVEventKind.STORED, tuple(chain[:prefix]))])
            publishers.append(pub)
        deadline = time.monotonic() + 10
        while any(p.applied_seq < 0 for p in publishers) and time.monotonic() < deadline:
            time.sleep(0.01)
        index = PrefixIndex(server.url, MODEL)
        miss = hash_chain([7] * 4096, 16, hash_extra(MODEL))
        for name, hashes in [("hit (4 workers, best 256 blocks)", chain), ("miss", miss)]:
            lat = []
            for _ in range(args.lookups):
                t0 = time.perf_counter()
                match = index.lookup(hashes)
                lat.append(time.perf_counter() - t0)
            lat.sort()
            p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
            best = match.best()
            print(
                f"  Redis lookup, 4k-token chain (256 blocks), {name}: p50 {p50 * 1e3:.3f} ms, "
                f"p99 {p99 * 1e3:.3f} ms, best={best}"
            )
        for pub in publishers:
            pub.close()
    return []


def print_table(rows: list[Row], raw_gbps: float | None) -> None:
    print(
        f"\n{'path':40s} {'MiB':>6s} {'descs posted (plan)':>20s} {'ms':>8s} {'GB/s':>7s} "
        f"{'best':>7s} {'% raw':>6s}"
    )
    for name, nbytes, descs, ms, gbps, best in rows:
        pct = f"{100 * gbps / raw_gbps:5.0f}%" if raw_gbps else "   -"
        print(
            f"{name:40s} {nbytes / 2**20:6.0f} {descs!s:>20s} {ms:8.2f} {gbps:7.2f} "
            f"{best:7.2f} {pct:>6s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="VRAM cuda:0 -> cuda:1 (2 GPUs)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=None, help="default 5 on CPU, 20 on GPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()
    args.iters = args.iters or (20 if args.gpu else 5)
    if args.gpu:
        if torch.cuda.device_count() < 2:
            sys.exit(f"--gpu needs 2 GPUs, found {torch.cuda.device_count()}")
        for var in ("UCX_TLS", "UCX_NET_DEVICES"):
            if var in os.environ:
                print(f"note: {var}={os.environ[var]} is set; unset it to let UCX pick cuda_ipc")
    else:
        os.environ.setdefault("UCX_TLS", "shm,tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    spec = make_spec(args)
    src_dev, dst_dev = ("cuda:0", "cuda:1") if args.gpu else ("cpu", "cpu")
    print(
        f"KV of {args.blocks * args.block_size} tokens: {args.blocks} blocks x "
        f"{spec.block_nbytes / 2**20:.2f} MiB = {args.blocks * spec.block_nbytes / 2**20:.0f} MiB "
        f"({args.layers} layers, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"{args.dtype}); "
        f"{src_dev} -> {dst_dev}; torch {torch.__version__}; UCX_TLS={os.environ.get('UCX_TLS')}"
    )
    if args.gpu:
        print("GPUs: " + ", ".join(torch.cuda.get_device_name(i) for i in range(2)))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_process, args=(child_conn, spec, src_dev), daemon=True)
    child.start()
    rows: list[Row] = []
    try:
        if not conn.poll(180):
            raise RuntimeError("the prefill process did not start within 180 s")
        tag, info = conn.recv()
        if tag != "ready":
            raise RuntimeError(f"the prefill process failed:\n{info}")
        device = torch.device(dst_dev)
        if args.gpu:
            torch.cuda.set_device(device)
        raw = stage("raw copy", lambda: bench_raw_copy(args, spec, args.gpu))
        rows += raw
        rows += stage("NIXL backend", lambda: bench_backend_modes(args, spec, info, device))
        rows += stage("DecodeEndpoint", lambda: bench_endpoint(args, spec, info, conn, device))
        print_table(rows, raw[0][4] if raw else None)
    except Exception as e:
        print(f"!! FAILED: setup: {e}")
    finally:
        with contextlib.suppress(OSError):
            conn.send(("exit",))
        child.join(20)
        if child.is_alive():
            child.kill()
    if not args.gpu and not args.skip_redis:
        print()
        stage("Redis lookup", lambda: bench_redis(args))


if __name__ == "__main__":
    main()
