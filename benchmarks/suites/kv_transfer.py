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
`--gpu --same-device` (1 GPU): both pools on cuda:0, in two processes (the one-GPU PD pair's
hand-off); raw = `copy_` within cuda:0. UCX's cuda_ipc GET is off by default where it sees no
NVLink (`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`), and a NIXL READ is a GET: the GPU backend sets
it to `y` unless the environment sets it (kv_transfer/nixl_backend.py); the run prints it.
Goal: NIXL coalesced >= 85% of the raw copy. Before the transfers, the run prints what
`add_peer` cost (prepping the peer's descriptors, once per peer) and how long building one
read's transfer handle takes in each descriptor mode (why `DescriptorMode.PREPPED` is the
default). Transfer cases run interleaved, so background load hits them alike. Every stage
catches and prints its own failure.

    python -m benchmarks kv_transfer               # CPU + Redis
    python -m benchmarks kv_transfer --blocks 64 --layers 4   # 256 KiB blocks
    python -m benchmarks kv_transfer --gpu         # 2-GPU NIXL VRAM->VRAM
    python -m benchmarks kv_transfer --gpu --same-device   # two processes, one GPU

On CPU, UCX moves host memory between processes with cma (process_vm_readv, a kernel copy),
below a user-space memcpy; the CPU path is for correctness, the GPU pair is the performance
target. The figures, with the machine and load of each run: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.harness.steps import StepLog
from benchmarks.harness.table import Table
from engine.kv.kv_cache import LAYOUT_NAMES, KVCache, KVCacheSpec, torch_dtype
from kv_transfer.protocol import HandshakeInfo
from kv_transfer.types import TransferPlan
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.numeric import percentile

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
        layout=LAYOUT_NAMES[args.layout],
    )


def block_of(cache: KVCache, block_id: int) -> torch.Tensor:
    """Every layer's K/V of one block (a strided view for a layer-major pool)."""
    return cache.tensor.select(cache.spec.block_dim, block_id)


def expected_block(spec: KVCacheSpec, block_id: int, device: torch.device) -> torch.Tensor:
    """The pattern the prefill process writes: element i of block b's view (`block_of`) is
    (b * block elements + i) % 251."""
    numel = spec.block_nbytes // spec.element_size
    idx = torch.arange(block_id * numel, (block_id + 1) * numel, device=device) % 251
    shape = list(spec.shape)
    del shape[spec.block_dim]
    return idx.to(torch_dtype(spec.dtype)).view(shape)


def prefill_process(conn: Connection, spec: KVCacheSpec, device: str) -> None:
    """Own the source pool behind a PrefillEndpoint; answer hand_off requests."""
    try:
        from kv_transfer.prefill_endpoint import PrefillEndpoint

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        cache = KVCache(spec, device)
        for b in range(spec.num_blocks):
            block_of(cache, b).copy_(expected_block(spec, b, cache.device))
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


def ucx_hint(error: BaseException) -> str | None:
    """The UCX settings, under a failure of NIXL or UCX."""
    if "UCX" in str(error) or "NIXL" in str(error) or "nixl" in type(error).__module__:
        return f"UCX_TLS={os.environ.get('UCX_TLS')!r} (unset on GPU; shm,tcp on CPU)"
    return None


def summarize(name: str, nbytes: int, descs: str, times: list[float]) -> Row:
    med = statistics.median(times)
    return (name, nbytes, descs, med * 1e3, nbytes / med / 1e9, nbytes / min(times) / 1e9)


@dataclass
class Case:
    """One way of moving the same bytes; `run()` moves them once and returns the seconds."""

    name: str
    nbytes: int
    run: Callable[[], float]
    check: Callable[[], None] = lambda: None
    descs: Callable[[], str] = lambda: "-"
    times: list[float] = field(default_factory=list)
    failed: bool = False


def pool_devices(args: argparse.Namespace) -> tuple[str, str]:
    """(the prefill process's device, this process's) for the run's flags."""
    if not args.gpu:
        return "cpu", "cpu"
    return ("cuda:0", "cuda:0") if args.same_device else ("cuda:0", "cuda:1")


def raw_copy_cases(args: argparse.Namespace, spec: KVCacheSpec) -> list[Case]:
    nbytes = args.blocks * spec.block_nbytes
    src_dev, dst_dev = pool_devices(args)
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    gpus = sorted({torch.device(d).index or 0 for d in (src_dev, dst_dev)}) if args.gpu else []

    def timed(op: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            for g in gpus:
                torch.cuda.synchronize(g)
            t0 = time.perf_counter()
            op()
            for g in gpus:
                torch.cuda.synchronize(g)
            return time.perf_counter() - t0

        return run

    name = f"raw copy_ {src_dev} -> {dst_dev}" if args.gpu else "raw copy_ (memcpy)"
    cases = [Case(name, nbytes, timed(lambda: dst.copy_(src)))]
    if args.gpu and not args.same_device:
        cases.append(Case("raw tensor.to('cuda:1')", nbytes, timed(lambda: src.to(dst_dev))))
    return cases


def backend_cases(
    args: argparse.Namespace, spec: KVCacheSpec, info: HandshakeInfo, device: torch.device
) -> list[Case]:
    """The project's NixlBackend in each descriptor mode, polled in a tight loop."""
    from kv_transfer.backend import XferStatus
    from kv_transfer.config import DescriptorMode
    from kv_transfer.nixl_backend import NixlBackend
    from kv_transfer.plan import plan_transfer
    from vocabulary.kv_handle import KVHandle

    cache = KVCache(spec, device)
    backend = NixlBackend("bench-decode-direct", cache, capture_telemetry=True)
    t0 = time.perf_counter()
    backend.add_peer(info.agent_name, info.agent_metadata, info.region)
    took = (time.perf_counter() - t0) * 1e3
    pieces = info.region.num_blocks * info.region.num_segments
    print(f"add_peer (load the peer's metadata, prep its {pieces} pieces once): {took:.1f} ms")
    n = args.blocks
    perm = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    contiguous = list(range(n))
    layouts = [
        ("NIXL prepped, contiguous (merged)", DescriptorMode.PREPPED, contiguous, contiguous),
        ("NIXL initialize_xfer, coalesced", DescriptorMode.COALESCED, contiguous, contiguous),
        ("NIXL initialize_xfer, per block", DescriptorMode.PER_BLOCK, contiguous, contiguous),
        ("NIXL prepped, scattered blocks", DescriptorMode.PREPPED, perm[:n], perm[n : 2 * n]),
    ]
    cases = []
    plans = []
    for name, mode, remote, local in layouts:
        handle = KVHandle("bench", "p", info.agent_name, tuple(remote), (), n, 0.0, "")
        plan = plan_transfer(handle, local, spec.block_nbytes, num_segments=spec.num_segments)
        plans.append((name, mode, plan))
        posted: list[int | None] = [None]

        def run(
            mode: DescriptorMode = mode, plan: TransferPlan = plan, posted: list = posted
        ) -> float:
            backend.mode = mode
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            xfer = backend.start_read(plan, b"")
            while (status := backend.poll(xfer)) is XferStatus.IN_PROGRESS:
                pass
            elapsed = time.perf_counter() - t0
            posted[0] = backend.descriptor_count(xfer)
            backend.release(xfer)
            if status is not XferStatus.DONE:
                raise RuntimeError(f"read ended {status}")
            return elapsed

        def check(plan: TransferPlan = plan) -> None:
            for j in (0, n // 2, n - 1):
                remote_id, local_id = plan.remote_block_ids[j], plan.local_block_ids[j]
                want = expected_block(spec, remote_id, device)
                if not torch.equal(block_of(cache, local_id), want):
                    raise RuntimeError(f"block {remote_id} -> {local_id}: bytes differ")

        def descs(plan: TransferPlan = plan, posted: list = posted) -> str:
            return f"{posted[0]} ({plan.num_descriptors})"

        cases.append(Case(name, plan.nbytes, run, check, descs))
    time_handles(backend, plans)
    return cases


def time_handles(
    backend: Any, plans: list[tuple[str, Any, TransferPlan]], rounds: int = 20
) -> None:
    """Print the µs to build a read's transfer handle in each descriptor mode, without posting
    it: what `DescriptorMode` changes (`NixlBackend.start_read` is this plus the post, and on
    host memory UCX copies inside the post). Median of `rounds`; reaches into the backend for
    the handle alone."""
    print(f"transfer handle creation, not posted (median of {rounds}):")
    for name, mode, plan in plans:
        backend.mode = mode
        peer = backend._peers[plan.peer]
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            handle = backend._make_read(plan, peer, b"")
            times.append(time.perf_counter() - t0)
            handle.release()
        print(f"  {name:40s} {plan.num_blocks:4d} blocks  {statistics.median(times) * 1e6:7.0f} µs")


def endpoint_case(
    args: argparse.Namespace,
    spec: KVCacheSpec,
    info: HandshakeInfo,
    conn: Connection,
    device: torch.device,
) -> list[Case]:
    """The full decode path: DecodeEndpoint.submit -> on_done (thread, budget, poll interval)."""
    from kv_transfer.decode_endpoint import DecodeEndpoint
    from kv_transfer.manager import TransferOutcome

    done = threading.Event()
    outcomes: list[TransferOutcome] = []

    def on_outcome(o: TransferOutcome) -> None:
        outcomes.append(o)
        done.set()

    endpoint = DecodeEndpoint(KVCache(spec, device), MODEL, "bench-decode", on_outcome, on_outcome)
    endpoint.start()
    endpoint.add_peer(info)
    blocks = list(range(args.blocks))
    count = [0]

    def run() -> float:
        count[0] += 1
        conn.send(("hand_off", f"e2e-{count[0]}", blocks))
        handle = conn.recv()
        done.clear()
        t0 = time.perf_counter()
        endpoint.submit(handle, blocks)
        if not done.wait(60):
            raise RuntimeError("no outcome within 60 s")
        elapsed = time.perf_counter() - t0
        if outcomes[-1].error is not None:
            raise outcomes[-1].error
        return elapsed

    return [Case("DecodeEndpoint submit -> on_done", args.blocks * spec.block_nbytes, run)]


def run_interleaved(cases: list[Case], warmup: int, iters: int) -> list[Row]:
    """Round-robin over the cases, so background load hits every case alike."""
    for i in range(warmup + iters):
        for case in cases:
            if case.failed:
                continue
            try:
                elapsed = case.run()
                if i >= warmup:
                    case.times.append(elapsed)
                if i == 0:
                    case.check()
            except Exception as e:
                case.failed = True
                print(f"\n!! FAILED: {case.name}: {type(e).__name__}: {e}")
                traceback.print_exc()
    return [
        summarize(c.name, c.nbytes, c.descs(), c.times) for c in cases if not c.failed and c.times
    ]


def bench_redis(args: argparse.Namespace) -> None:
    from deploy.control.embedded_redis import EmbeddedRedis
    from prefix_index.config import PrefixIndexConfig
    from prefix_index.index import PrefixIndex
    from prefix_index.publisher import KVEventPublisher
    from vocabulary.kv_events import CacheSnapshot, KVEvent, KVEventKind

    chain = hash_chain(list(range(4096)), 16, hash_extra(MODEL))
    with EmbeddedRedis() as server:
        publishers = []
        for w, prefix in enumerate([256, 200, 64, 16]):  # 4 live workers, different prefixes
            pub = KVEventPublisher(server.url, MODEL, f"w{w}", lambda: CacheSnapshot(-1, ()))
            pub.start()
            pub.publish([KVEvent(0, KVEventKind.STORED, tuple(chain[:prefix]))])
            publishers.append(pub)
        deadline = time.monotonic() + 10
        while any(p.applied_seq < 0 for p in publishers) and time.monotonic() < deadline:
            time.sleep(0.01)
        # A generous timeout here: a lookup that timed out would measure the circuit breaker.
        index = PrefixIndex(server.url, MODEL, PrefixIndexConfig(socket_timeout_s=2.0))
        miss = hash_chain([7] * 4096, 16, hash_extra(MODEL))
        for name, hashes in [("hit, 4 workers (256/200/64/16 blocks)", chain), ("miss", miss)]:
            lat = []
            for _ in range(args.lookups):
                t0 = time.perf_counter()
                match = index.lookup(hashes)
                lat.append(time.perf_counter() - t0)
            p50, p99 = percentile(lat, 50), percentile(lat, 99)
            answer = [(w.worker_id, w.num_blocks) for w in match.workers]
            print(
                f"  Redis lookup, 4k-token chain (256 blocks), {name}: p50 {p50 * 1e3:.3f} ms, "
                f"p99 {p99 * 1e3:.3f} ms; answer {answer}; "
                f"unavailable so far {index.num_unavailable} of {index.num_lookups}"
            )
        for pub in publishers:
            pub.close()


def print_table(rows: list[Row], raw_gbps: float | None) -> None:
    header = ("path", "MiB", "descs posted (plan)", "ms", "GB/s", "best", "% raw")
    lines = [
        (name, f"{nbytes / 2**20:.0f}", descs, f"{ms:.2f}", f"{gbps:.2f}", f"{best:.2f}",
         f"{100 * gbps / raw_gbps:.0f}%" if raw_gbps else "-")
        for name, nbytes, descs, ms, gbps, best in rows
    ]  # fmt: skip
    print("\n" + Table.of(header, lines).plain())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="VRAM cuda:0 -> cuda:1 (2 GPUs)")
    parser.add_argument(
        "--same-device", action="store_true",
        help="with --gpu: both pools on cuda:0, two processes (the one-GPU PD pair; 1 GPU)",
    )  # fmt: skip
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--layout", default="block_major", choices=("block_major", "layer_major"),
        help="the pools' layout (engine/kv/kv_cache.py): layer_major moves a descriptor per layer",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=None, help="default 5 on CPU, 20 on GPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--only-redis", action="store_true", help="just the Redis lookup (CPU)")
    args = parser.parse_args(argv)
    log = StepLog(hint=ucx_hint)
    args.iters = args.iters or (20 if args.gpu else 5)
    if args.same_device and not args.gpu:
        raise SystemExit("--same-device: only with --gpu (a CPU run is one host's memory already)")
    if args.gpu:
        need = 1 if args.same_device else 2
        if torch.cuda.device_count() < need:
            raise SystemExit(f"--gpu needs {need} GPU(s), found {torch.cuda.device_count()}")
        get = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "unset: the backend sets y")
        print(f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={get}")
        for var in ("UCX_TLS", "UCX_NET_DEVICES"):
            if var in os.environ:
                print(f"note: {var}={os.environ[var]} is set; unset it to let UCX pick cuda_ipc")
    else:
        os.environ.setdefault("UCX_TLS", "shm,tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.only_redis:
        log.step("Redis lookup", lambda: bench_redis(args))
        return
    spec = make_spec(args)
    src_dev, dst_dev = pool_devices(args)
    print(
        f"KV of {args.blocks * args.block_size} tokens: {args.blocks} blocks x "
        f"{spec.block_nbytes / 2**20:.2f} MiB = {args.blocks * spec.block_nbytes / 2**20:.0f} MiB "
        f"({args.layers} layers, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"{args.dtype}, {args.layout}); "
        f"{src_dev} -> {dst_dev}; torch {torch.__version__}; UCX_TLS={os.environ.get('UCX_TLS')}"
    )
    if args.gpu:
        n = 1 if args.same_device else 2
        print("GPUs: " + ", ".join(torch.cuda.get_device_name(i) for i in range(n)))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_process, args=(child_conn, spec, src_dev), daemon=True)
    child.start()
    try:
        if not conn.poll(180):
            raise RuntimeError("the prefill process did not start within 180 s")
        tag, info = conn.recv()
        if tag != "ready":
            raise RuntimeError(f"the prefill process failed:\n{info}")
        device = torch.device(dst_dev)
        if args.gpu:
            torch.cuda.set_device(device)
        cases = log.step("raw copy setup", lambda: raw_copy_cases(args, spec)) or []
        cases += (
            log.step("NIXL backend setup", lambda: backend_cases(args, spec, info, device)) or []
        )
        cases += (
            log.step("DecodeEndpoint setup", lambda: endpoint_case(args, spec, info, conn, device))
            or []
        )
        print(f"running {len(cases)} cases interleaved, {args.warmup} + {args.iters} rounds ...")
        rows = run_interleaved(cases, args.warmup, args.iters)
        raw = [r for r in rows if r[0].startswith("raw copy_")]
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
        log.step("Redis lookup", lambda: bench_redis(args))
