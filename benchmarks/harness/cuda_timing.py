"""Timing the suites share: seconds per call with the device drained at both ends, a device's
copy bandwidth (the floor every decode figure is judged against) and the bf16 matmul rate
(the prefill floor), the time of a body of launches replayed as one CUDA graph (as serving
runs them: no launch overhead between kernels), the kernels a step launches, and random KV
to time them over. `sync`, `seconds_per_call`, `median_seconds` and the copies run on the
CPU too; the rest need CUDA."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(*devices: torch.device) -> None:
    """Wait for the queued work of each of `devices` (nothing to wait for on the CPU)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def seconds_per_call(
    fn: Callable[[], object], iters: int, *devices: torch.device, warmup: int = 3
) -> float:
    """Mean wall seconds per call of `fn` over `iters` calls after `warmup`, host and device
    included (each of `devices` drained before and after the timed calls)."""
    for _ in range(warmup):
        fn()
    sync(*devices)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(*devices)
    return (time.perf_counter() - t0) / iters


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `fn` over `reps` calls after one: each timed alone, by CUDA events
    on a GPU (device time), by the wall clock on the CPU."""
    fn()
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


def copy_seconds(src: torch.device, dst: torch.device, nbytes: int, iters: int = 20) -> float:
    """Mean seconds of one copy of `nbytes` from `src` to `dst` (both drained)."""
    a = torch.full((nbytes,), 3, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    return seconds_per_call(lambda: b.copy_(a), iters, *{src, dst})


def copy_bytes_per_s(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Bytes/s of a copy of `nbytes` within `device`, read and write counted."""
    return 2 * nbytes / copy_seconds(device, device, nbytes, iters)


def hbm_gbps() -> float:
    """The current CUDA device's copy bandwidth, read + write counted (GB/s)."""
    return copy_bytes_per_s(torch.device("cuda"), 1 << 30) / 1e9


def matmul_flops_per_s(n: int = 8192) -> float:
    """bf16 n^3 matmul rate on the current CUDA device, FLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / seconds_per_call(lambda: a @ b, 20, torch.device("cuda"))


def fill_random(tensor: torch.Tensor, bound: float) -> None:
    """Normal values clamped to ±bound, in the tensor's dtype (e4m3 included), a 2^28-element
    slice at a time: a 20 GB pool needs no float32 temporary of four times its size."""
    flat = tensor.view(-1)
    for i in range(0, flat.numel(), 1 << 28):
        part = flat[i : i + (1 << 28)]
        part.copy_(torch.randn(part.shape, device=tensor.device).clamp(-bound, bound))


def graph_seconds(body: Callable[[], object], iters: int = 20) -> float:
    """Seconds per replay of one CUDA-graph capture of body() (run once eagerly first, so
    kernels compile and allocations settle outside the capture)."""
    body()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def kernel_profile(run: Callable[[], object], steps: int = 5) -> None:
    """Print the CUDA time per step of the kernels `run` launches, largest first, grouped by
    name (kernels replayed from a CUDA graph included)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us, n = kernels.get(e.name, (0.0, 0))
        kernels[e.name] = (us + e.time_range.elapsed_us(), n + 1)
    total = sum(us for us, _ in kernels.values()) / steps
    print(f"   kernels per step: {sum(n for _, n in kernels.values()) // steps}, "
          f"CUDA time {total / 1e3:.2f} ms")  # fmt: skip
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"   {us / steps / 1e3:7.3f} ms {n // steps:5d}x  {name[:110]}")
