"""SM partitions on one GPU: what a CUDA green context of N SMs gives a matmul (prefill's
bound) and a streaming read (decode's bound), alone and beside each other, and whether a CUDA
graph captured on a partition's stream stays on it when replayed.

    python -m benchmarks sm_partition [--shares 16,32,48,66,84,100,116] [--json OUT]

Prints the green-context APIs this machine has, then one table per question. Every figure is
timed with CUDA events on the partition's own stream, several repeats, median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def api_surface() -> dict[str, Any]:
    """Which ways to make a green context exist here."""
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        from torch.cuda import green_contexts

        gc = green_contexts.GreenContext
        out["torch_green_context"] = sorted(n for n in dir(gc) if not n.startswith("__"))
        out["torch_green_supported"] = bool(getattr(green_contexts, "SUPPORTED", True))
    except Exception as e:  # a probe: report whatever fails
        out["torch_green_context"] = f"unavailable: {e!r}"
    try:
        import flashinfer.green_ctx as fgc

        out["flashinfer_green_ctx"] = sorted(n for n in dir(fgc) if not n.startswith("_"))
    except Exception as e:
        out["flashinfer_green_ctx"] = f"unavailable: {e!r}"
    try:
        import cuda.bindings.driver as drv  # noqa: F401

        out["cuda_bindings"] = True
    except Exception as e:
        out["cuda_bindings"] = f"unavailable: {e!r}"
    out["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    return out


class Partition:
    """A stream whose kernels run on `granted` SMs (or the whole device)."""

    def __init__(self, stream: torch.cuda.Stream, asked: int, granted: int, how: str) -> None:
        self.stream, self.asked, self.granted, self.how = stream, asked, granted, how
        self.keep: Any = None


def make_partition(num_sms: int) -> Partition:
    """A green-context stream of `num_sms` SMs (the whole device when that is all of it),
    made as a split engine makes its partitions (engine/core/sm_split.py)."""
    from engine.core.sm_split import green_context_stream

    total = torch.cuda.get_device_properties(0).multi_processor_count
    if num_sms >= total:
        return Partition(torch.cuda.Stream(), num_sms, total, "whole device")
    made = green_context_stream(torch.device("cuda", 0), num_sms)
    assert made.stream is not None
    part = Partition(made.stream, num_sms, made.sms, type(made.keep).__module__)
    part.keep = made.keep
    return part


def make_pair(decode_sms: int) -> tuple[Partition, Partition]:
    """(decode, prefill) on disjoint SMs, as a split engine makes them (one split of the
    device: `partition_pair`; two `make_partition`s would share their first SM groups)."""
    from engine.core.sm_split import partition_pair

    total = torch.cuda.get_device_properties(0).multi_processor_count
    prefill, decode = partition_pair(torch.device("cuda", 0), decode_sms, total)
    parts = []
    for made, asked in ((decode, decode_sms), (prefill, total - decode_sms)):
        assert made.stream is not None
        part = Partition(made.stream, asked, made.sms, "flashinfer.green_ctx")
        part.keep = made.keep
        parts.append(part)
    return parts[0], parts[1]


def timed(stream: torch.cuda.Stream, fn: Callable[[], None], reps: int = 10) -> float:
    """Median seconds of `fn` on `stream` (after a warm-up)."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


Work = dict[str, tuple[Callable[[], None], float, str]]
"""Workload name -> (one call of it, units it does per call, unit)."""


def workloads() -> Work:
    """name -> (work, units per call, unit)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(2 << 30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    # decode's weight stream: M=64 rows against 32 distinct 4096x14336 bf16 matrices (3.8 GB)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(32)]

    def matmul() -> None:
        torch.mm(a, b)

    def copy() -> None:
        dst.copy_(src)

    def gemv() -> None:
        for w in ws:
            torch.mm(x, w)

    return {
        "matmul 8192x8192x4096 (TFLOP/s)": (matmul, 2 * 8192 * 8192 * 4096 / 1e12, "TFLOP/s"),
        "HBM copy 2 GiB (GB/s, read+write)": (copy, 2 * (2 << 30) / 1e9, "GB/s"),
        "decode GEMMs M=64 over 3.8 GB of weights (GB/s)": (
            gemv,
            sum(w.numel() * 2 for w in ws) / 1e9,
            "GB/s",
        ),
    }


def alone(shares: list[int], work: Work) -> list[dict[str, Any]]:
    rows = []
    for share in shares:
        part = make_partition(share)
        row: dict[str, Any] = {"asked": share, "granted": part.granted, "how": part.how}
        for name, (fn, units, _) in work.items():
            row[name] = units / timed(part.stream, fn)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _loop(part: Partition, fn: Callable[[], None], stop_at: float) -> int:
    """Run `fn` on `part` (each call waited for) until `stop_at`; the number of calls."""
    n = 0
    with torch.cuda.stream(part.stream):
        while time.perf_counter() < stop_at:
            fn()
            part.stream.synchronize()
            n += 1
    return n


def side_by_side(decode_sms: int, work: Work, seconds: float = 2.0) -> dict[str, Any]:
    """The decode GEMMs on a partition of `decode_sms` and the matmul on the rest, each on a
    thread of its own looping for `seconds`: rates beside each other vs alone."""
    dec, pre = make_pair(decode_sms)
    names = list(work)
    mm_fn, mm_units, _ = work[names[0]]
    gv_fn, gv_units, _ = work[names[2]]
    result: dict[str, Any] = {"decode_sms": dec.granted, "prefill_sms": pre.granted}
    t0 = time.perf_counter()
    n = _loop(dec, gv_fn, t0 + seconds)
    result["decode GB/s alone"] = n * gv_units / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n = _loop(pre, mm_fn, t0 + seconds)
    result["prefill TFLOP/s alone"] = n * mm_units / (time.perf_counter() - t0)
    counts: dict[str, int] = {}

    def run(key: str, part: Partition, fn: Callable[[], None], stop_at: float) -> None:
        counts[key] = _loop(part, fn, stop_at)

    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=run, args=("decode", dec, gv_fn, t0 + seconds)),
        threading.Thread(target=run, args=("prefill", pre, mm_fn, t0 + seconds)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    result["decode GB/s together"] = counts["decode"] * gv_units / wall
    result["prefill TFLOP/s together"] = counts["prefill"] * mm_units / wall
    print(json.dumps(result), flush=True)
    return result


def graph_stays(share: int, work: Work) -> dict[str, Any]:
    """A matmul captured into a CUDA graph on a partition's stream, replayed there: its rate
    against the same matmul eager on that partition and on the whole device."""
    part = make_partition(share)
    fn, units, _ = work[next(iter(work))]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(part.stream):
        fn()
        part.stream.synchronize()
        with torch.cuda.graph(graph, stream=part.stream):
            fn()
    eager = units / timed(part.stream, fn)
    replay = units / timed(part.stream, graph.replay)
    other = torch.cuda.Stream()
    replay_elsewhere = units / timed(other, graph.replay)
    whole = units / timed(other, fn)
    row = {"sms": part.granted, "eager TFLOP/s": eager, "graph replay TFLOP/s": replay,
           "graph replayed on a whole-device stream TFLOP/s": replay_elsewhere,
           "whole device TFLOP/s": whole}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="16,32,48,66,84,100,116")
    ap.add_argument("--decode-sms", default="16,32,48")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"api": api_surface()}
    print(json.dumps(report["api"], indent=1), flush=True)
    work = workloads()
    total = report["api"]["sm_count"]
    shares = [int(s) for s in args.shares.split(",")] + [total]
    try:
        report["alone"] = alone(shares, work)
        report["side_by_side"] = [side_by_side(int(d), work) for d in args.decode_sms.split(",")]
        report["graph"] = graph_stays(int(shares[1]), work)
    except RuntimeError as e:
        report["error"] = str(e)
        print("green contexts failed:", e, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
